"""The LoRA update for a few tokens (decode) in one kernel, added onto the base output in place.

For T <= 64 rows the update ``((x @ A.T) * scale) @ B.T`` is tiny work spread over three or
more launches (shrink GEMM, scale, expand GEMM with the add), each a few microseconds of fixed
cost, which is why a dynamic adapter can double a decode step. :func:`lora_decode_add` does it
in one launch: each program owns BN output columns, recomputes the whole (T, R) intermediate
``h`` (K x R of the down factor and T x K of x are read from L2 by every program; at decode
sizes that is cheaper than a second launch), scales it in float32, multiplies it by its columns
of the up factor in float32 (``h`` is never rounded), adds the base output tile and rounds once.

:func:`lora_decode_add_reference` is the same computation in PyTorch: the fallback and oracle.
"""

from __future__ import annotations

import functools

import torch

from shuttle.kernels.launch import (
    bind_tiles,
    cdiv,
    interpreting,
    next_power_of_2,
    triton_available,
)

__all__ = ["DECODE_MAX_T", "lora_decode_add", "lora_decode_add_reference"]

DECODE_MAX_T = 64  # rows the kernel takes: one program holds all of x's rows
_DTYPES = (torch.bfloat16, torch.float16)
_MAX_R = 256  # the (T, R) intermediate and (R, BN) factor tile stay in registers


def lora_decode_add_reference(out: torch.Tensor, x: torch.Tensor, down: torch.Tensor,
                              up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``out += ((x @ down.T) * scale) @ up.T`` in float32, rounded once into ``out``."""
    h = (x.float() @ down.float().T) * scale.float()
    out.copy_(out.float().addmm_(h, up.float().T))
    return out


# Shared tile helpers, bound by bind_tiles() when the kernels are built (see there).
store_rne = None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    bind_tiles(globals(), "store_rne")

    @triton.jit
    def decode_kernel(x_ptr, d_ptr, u_ptr, scale_ptr, o_ptr, T, K, N, R,
                      stride_xt, stride_dr, stride_un, stride_ot,
                      BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                      IEEE: tl.constexpr):
        rt = tl.arange(0, BT)
        rr = tl.arange(0, BR)
        rk = tl.arange(0, BK)
        # h = x @ down.T over K: (BT, BR) in float32 (bf16/fp16 products are exact in it).
        h = tl.zeros((BT, BR), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            kk = k * BK + rk
            x = tl.load(x_ptr + rt[:, None] * stride_xt + kk[None, :],
                        mask=(rt[:, None] < T) & (kk[None, :] < K), other=0.0)
            d = tl.load(d_ptr + rr[None, :] * stride_dr + kk[:, None],
                        mask=(rr[None, :] < R) & (kk[:, None] < K), other=0.0)
            if IEEE:  # the interpreter, whose bf16 dot is wrong
                h = tl.dot(x.to(tl.float32), d.to(tl.float32), h, input_precision="ieee")
            else:
                h = tl.dot(x, d, h)
        h = h * tl.load(scale_ptr + rr, mask=rr < R, other=0.0)[None, :]
        # This program's columns: out[:, rn] += h @ up[rn].T, all in float32.
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        u = tl.load(u_ptr + rn[None, :] * stride_un + rr[:, None],
                    mask=(rr[:, None] < R) & (rn[None, :] < N), other=0.0)
        delta = tl.dot(h, u.to(tl.float32), input_precision="ieee")
        mask = (rt[:, None] < T) & (rn[None, :] < N)
        o_ptrs = o_ptr + rt[:, None] * stride_ot + rn[None, :]
        store_rne(o_ptrs, tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32) + delta, mask)

    return decode_kernel


def lora_decode_add(out: torch.Tensor, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
                    scale: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """In place: ``out += ((x @ down.T) * scale) @ up.T``, float32 throughout, one rounding.

    Args:
        out: (T, N) the base output, T <= :data:`DECODE_MAX_T`, bf16/fp16, unit column stride.
        x: (T, K) activations of ``out``'s dtype.
        down: (R, K) and up: (N, R) factors of ``out``'s dtype (several adapters concatenated
            along R).
        scale: (R,) float32 per-rank scale.
        block_n: output columns per program.

    Returns:
        ``out``. Uses the Triton kernel on CUDA (or under ``TRITON_INTERPRET=1``) for these
        dtypes, else :func:`lora_decode_add_reference`.

    Raises:
        ValueError: shapes that do not fit together, or T above :data:`DECODE_MAX_T`.
    """
    t, k = x.shape
    n, r = up.shape
    if out.shape != (t, n) or down.shape != (r, k) or scale.shape != (r,):
        raise ValueError(f"lora_decode_add: out (T, N), x (T, K), down (R, K), up (N, R), scale "
                         f"(R,) expected, got {tuple(out.shape)}, {tuple(x.shape)}, "
                         f"{tuple(down.shape)}, {tuple(up.shape)}, {tuple(scale.shape)}")
    if t > DECODE_MAX_T:
        raise ValueError(f"lora_decode_add takes at most {DECODE_MAX_T} rows, got {t}")
    usable = (triton_available() and (out.is_cuda or interpreting())
              and {out.dtype, x.dtype, down.dtype, up.dtype} <= set(_DTYPES)
              and len({out.dtype, x.dtype, down.dtype, up.dtype}) == 1
              and out.stride(1) == 1 and x.stride(1) == 1 and down.stride(1) == 1
              and up.stride(1) == 1 and t > 0 and 0 < r <= _MAX_R)
    if not usable:
        return lora_decode_add_reference(out, x, down, up, scale)

    bt = max(16, next_power_of_2(t))
    br = max(16, next_power_of_2(r))
    bk = 16 if interpreting() else 128
    grid = (cdiv(n, block_n),)
    _kernel()[grid](x, down, up, scale.to(torch.float32).contiguous(), out, t, k, n, r,
                    x.stride(0), down.stride(0), up.stride(0), out.stride(0),
                    BT=bt, BK=bk, BR=br, BN=block_n, IEEE=interpreting(), num_warps=4)
    return out
