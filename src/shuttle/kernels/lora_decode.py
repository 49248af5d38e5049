"""LoRA at a few tokens (decode): the update in one kernel, or the whole layer in two.

For T <= 64 rows the update ``((x @ A.T) * scale) @ B.T`` is tiny work spread over three or
more launches (shrink GEMM, scale, expand GEMM with the add), each a few microseconds of fixed
cost, which is why a dynamic adapter can double a decode step. :func:`lora_decode_add` does it
in one launch: each program owns BN output columns, recomputes the whole (T, R) intermediate
``h`` (K x R of the down factor and T x K of x are read from L2 by every program; at decode
sizes that is cheaper than a second launch), scales it in float32, multiplies it by its columns
of the up factor in float32 (``h`` is never rounded), adds the base output tile and rounds once.

:func:`lora_decode_linear` is the fused tier's decode form: the whole layer
``x @ W.T + ((x @ A.T) * scale) @ B.T + bias``. A split-K shrink writes float32 partials of
``h = x @ A.T`` (a few small programs, one per K range); then each output program streams its BN
rows of W once (at decode the layer is bound by reading W), sums the partials in a fixed order,
adds ``(h * scale) @ B[rn].T`` (float32, ``h`` never rounded) and the bias, and rounds once. No
base output is written and read back. (A one-launch form, every output program accumulating
the whole of ``h`` beside its base product, is slower: its extra per-step loads of A cost more
than the second launch.)

:func:`lora_decode_add_reference` and :func:`lora_decode_linear_reference` are the same
computations in PyTorch: the fallbacks and oracles.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from shuttle.kernels.launch import (
    CompiledLaunch,
    cdiv,
    interpreting,
    next_power_of_2,
    on_device_of,
    sm_count,
    triton_available,
)

__all__ = [
    "DECODE_LINEAR_CONFIG",
    "DECODE_MAX_T",
    "DecodeConfig",
    "lora_decode_add",
    "lora_decode_add_reference",
    "lora_decode_linear",
    "lora_decode_linear_reference",
]

DECODE_MAX_T = 64  # rows the kernel takes: one program holds all of x's rows
_DTYPES = (torch.bfloat16, torch.float16)
_MAX_R = 256  # the (T, R) intermediate and (R, BN) factor tile stay in registers


def lora_decode_add_reference(out: torch.Tensor, x: torch.Tensor, down: torch.Tensor,
                              up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``out += ((x @ down.T) * scale) @ up.T`` in float32, rounded once into ``out``."""
    h = (x.float() @ down.float().T) * scale.float()
    out.copy_(out.float().addmm_(h, up.float().T))
    return out


def lora_decode_linear_reference(x: torch.Tensor, weight: torch.Tensor,
                                 bias: torch.Tensor | None, down: torch.Tensor, up: torch.Tensor,
                                 scale: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T + ((x @ down.T) * scale) @ up.T + bias`` in float32, rounded once."""
    xf = x.float()
    h = (xf @ down.float().T) * scale.float()
    out = torch.addmm(xf @ weight.float().T, h, up.float().T)
    if bias is not None:
        out.add_(bias.float())
    return out.to(x.dtype)


# Shared tile helpers, bound by tiles.bind_tiles() when the kernels are built (see there).
shrink_step = store_rne = None


@functools.cache
def _kernel():
    return _kernels()[0]


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    from shuttle.kernels.tiles import bind_tiles

    bind_tiles(globals(), "shrink_step", "store_rne")

    # The kernels' runtime arguments are unspecialized: one binary per dtypes and constexprs,
    # launched from it by CompiledLaunch (at decode the host is the bottleneck, and Triton's
    # per-call dispatch is about half of a launch's host time). What specialization told the
    # compiler about alignment, ALIGNED tells it (see _aligned): rows of x, of the weight or
    # down factor and of the output start on 16 bytes and K, N are multiples of 16, so loads
    # along K and stores along N are 16-byte vectors (the hints go on the pointer and mask
    # tensors: Triton drops them on scalar arguments).
    @triton.jit(do_not_specialize=["x_ptr", "d_ptr", "u_ptr", "scale_ptr", "o_ptr", "T", "K",
                                   "N", "R", "stride_xt", "stride_dr", "stride_un",
                                   "stride_ot"])
    def decode_kernel(x_ptr, d_ptr, u_ptr, scale_ptr, o_ptr, T, K, N, R,
                      stride_xt, stride_dr, stride_un, stride_ot,
                      BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                      IEEE: tl.constexpr, ALIGNED: tl.constexpr, UP_ALIGNED: tl.constexpr):
        rt = tl.arange(0, BT)
        rr = tl.arange(0, BR)
        rk = tl.arange(0, BK)
        # h = x @ down.T over K: (BT, BR) in float32 (bf16/fp16 products are exact in it).
        h = tl.zeros((BT, BR), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            h = shrink_step(h, x_ptr, d_ptr, rt, rr, k * BK + rk, T, R, K, stride_xt,
                            stride_dr, IEEE, ALIGNED)
        h = h * tl.load(scale_ptr + rr, mask=rr < R, other=0.0)[None, :]
        # This program's columns: out[:, rn] += h @ up[rn].T, all in float32.
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        u_ptrs = u_ptr + rn[None, :] * stride_un + rr[:, None]
        u_mask = (rr[:, None] < R) & (rn[None, :] < N)
        if UP_ALIGNED:  # rows of up start on 16 bytes and R is a multiple of 16
            u_ptrs = tl.multiple_of(u_ptrs, [16, 16])
            u_mask = tl.max_constancy(u_mask, [16, 1])
        u = tl.load(u_ptrs, mask=u_mask, other=0.0)
        delta = tl.dot(h, u.to(tl.float32), input_precision="ieee")
        mask = (rt[:, None] < T) & (rn[None, :] < N)
        o_ptrs = o_ptr + rt[:, None] * stride_ot + rn[None, :]
        if ALIGNED:  # N is a multiple of 16 too
            o_ptrs = tl.multiple_of(o_ptrs, [16, 16])
            mask = tl.max_constancy(mask, [1, 16])
        store_rne(o_ptrs, tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32) + delta, mask)

    @triton.jit(do_not_specialize=["x_ptr", "d_ptr", "ws_ptr", "T", "K", "R", "K_PER",
                                   "stride_xt", "stride_dr"])
    def partial_shrink_kernel(x_ptr, d_ptr, ws_ptr, T, K, R, K_PER, stride_xt, stride_dr,
                              BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                              IEEE: tl.constexpr, ALIGNED: tl.constexpr):
        # Program p: the float32 partial h_p = x[:, Kp] @ down[:, Kp].T over its K range,
        # stored whole, (BT, BR), at ws[p] (padding rows and ranks are zeros).
        pid = tl.program_id(0)
        rt = tl.arange(0, BT)
        rr = tl.arange(0, BR)
        rk = tl.arange(0, BK)
        k0 = pid * K_PER
        h = tl.zeros((BT, BR), dtype=tl.float32)
        for k in range(k0, tl.minimum(k0 + K_PER, K), BK):
            h = shrink_step(h, x_ptr, d_ptr, rt, rr, k + rk, T, R, K, stride_xt, stride_dr,
                            IEEE, ALIGNED)
        # A fresh float32 workspace of whole (BT, BR) tiles: rows start on 64 bytes.
        tl.store(tl.multiple_of(ws_ptr + pid * BT * BR + rt[:, None] * BR + rr[None, :],
                                [16, 16]), h)

    @triton.jit(do_not_specialize=["x_ptr", "w_ptr", "b_ptr", "u_ptr", "scale_ptr", "ws_ptr",
                                   "o_ptr", "T", "K", "N", "R", "stride_xt", "stride_wn",
                                   "stride_un", "stride_ot"])
    def linear_kernel(x_ptr, w_ptr, b_ptr, u_ptr, scale_ptr, ws_ptr, o_ptr, T, K, N, R,
                      stride_xt, stride_wn, stride_un, stride_ot,
                      BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                      H_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                      IEEE: tl.constexpr, ALIGNED: tl.constexpr):
        # acc = x @ W[rn].T over K, then h summed from partial_shrink_kernel's H_PARTS
        # partials in a fixed order (deterministic), acc += (h * scale) @ up[rn].T, + bias.
        rt = tl.arange(0, BT)
        rr = tl.arange(0, BR)
        rk = tl.arange(0, BK)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        # Rows of x past T are masked (no traffic: a wrapped row, as tiles.dot_over_k's callers
        # use, would be fetched again for every padding row, which made one token slower than
        # sixteen). Wrapped columns and ranks keep W and up loads in bounds without masks; the
        # scale (0 past R) and the store mask cancel what they add.
        row_ok = (rt < T)[:, None]
        rn_l = (rn % N).to(tl.int64)
        x_ptrs = x_ptr + rt[:, None] * stride_xt + rk[None, :]
        w_ptrs = w_ptr + rn_l[None, :] * stride_wn + rk[:, None]
        if ALIGNED:
            x_ptrs = tl.multiple_of(x_ptrs, [16, 16])
            w_ptrs = tl.multiple_of(w_ptrs, [16, 16])
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=row_ok, other=0.0)
                w = tl.load(w_ptrs)
            else:
                k_left = K - k * BK
                x_mask = row_ok & (rk[None, :] < k_left)
                w_mask = rk[:, None] < k_left
                if ALIGNED:  # K is a multiple of 16: the masks hold over runs of 16 along K
                    x_mask = tl.max_constancy(x_mask, [1, 16])
                    w_mask = tl.max_constancy(w_mask, [16, 1])
                x = tl.load(x_ptrs, mask=x_mask, other=0.0)
                w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            if IEEE:  # the interpreter, whose bf16 dot is wrong
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
            x_ptrs += BK
            w_ptrs += BK
        ws_ptrs = tl.multiple_of(ws_ptr + rt[:, None] * BR + rr[None, :], [16, 16])
        h = tl.load(ws_ptrs)
        for p in range(1, H_PARTS):
            h += tl.load(ws_ptrs + p * BT * BR)
        h = h * tl.load(scale_ptr + rr, mask=rr < R, other=0.0)[None, :]
        u = tl.load(u_ptr + rn_l[None, :] * stride_un + (rr % R)[:, None])
        acc = tl.dot(h, u.to(tl.float32), acc, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn_l).to(tl.float32)[None, :]
        mask = (rt[:, None] < T) & (rn[None, :] < N)
        o_ptrs = o_ptr + rt[:, None] * stride_ot + rn[None, :]
        if ALIGNED:  # N is a multiple of 16 too
            o_ptrs = tl.multiple_of(o_ptrs, [16, 16])
            mask = tl.max_constancy(mask, [1, 16])
        store_rne(o_ptrs, acc, mask)

    return (CompiledLaunch(decode_kernel), CompiledLaunch(linear_kernel),
            CompiledLaunch(partial_shrink_kernel))


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
    # Called once per adapted layer and token step, where the host is the bottleneck: the
    # checks are plain comparisons (no sets or generators: each costs a microsecond).
    interpret = interpreting()  # read once: an environment lookup costs microseconds
    dt = out.dtype
    usable = (triton_available() and (out.is_cuda or interpret) and dt in _DTYPES
              and x.dtype == dt and down.dtype == dt and up.dtype == dt
              and out.stride(1) == 1 and x.stride(1) == 1 and down.stride(1) == 1
              and up.stride(1) == 1 and t > 0 and 0 < r <= _MAX_R)
    if not usable:
        return lora_decode_add_reference(out, x, down, up, scale)

    if scale.dtype != torch.float32 or scale.stride(0) != 1:
        scale = scale.to(torch.float32).contiguous()
    sx, sd, su, so = x.stride(0), down.stride(0), up.stride(0), out.stride(0)
    aligned = (k % 16 == 0 and n % 16 == 0 and _rows_aligned(x, sx) and _rows_aligned(down, sd)
               and _rows_aligned(out, so))
    with on_device_of(x):
        _kernel()((cdiv(n, block_n),), x, down, up, scale, out, t, k, n, r, sx, sd, su, so,
                  BT=max(16, next_power_of_2(t)), BK=16 if interpret else 128,
                  BR=max(16, next_power_of_2(r)), BN=block_n, IEEE=interpret, ALIGNED=aligned,
                  UP_ALIGNED=r % 16 == 0 and _rows_aligned(up, su), num_warps=4)
    return out


def _rows_aligned(t: torch.Tensor, row_stride: int) -> bool:
    """Every row of the 2-D ``t`` of 2-byte elements starts on 16 bytes."""
    return t.data_ptr() % 16 == 0 and row_stride % 8 == 0


def _aligned(*tensors: torch.Tensor, sizes: tuple[int, ...]) -> bool:
    """The kernels' alignment flags: ``sizes`` (K, N or R: what the masks compare with) are
    multiples of 16, and the 2-D tensors of 2-byte elements have every row start on 16 bytes
    (aligned start, row stride a multiple of 8 elements).
    """
    return all(v % 16 == 0 for v in sizes) and all(
        t.element_size() == 2 and _rows_aligned(t, t.stride(0)) for t in tensors)


class DecodeConfig(NamedTuple):
    """Launch parameters of :func:`lora_decode_linear` (a plain tuple in this order works too)."""

    block_n: int  # output columns per program
    block_k: int  # base reduction step
    num_warps: int
    num_stages: int
    shrink_k: int  # K elements per partial-shrink program (> 0)


# At decode the layer is bound by reading W once: column tiles narrow enough for every SM to
# stream its share, block_n 64 where that still gives 1.5 programs per SM, else 32 (the choice
# of tile, steps and warps: docs/benchmarks/fused_breakdown_decode.md). h comes from partials of
# 256 K elements each, written by a separate split-K shrink: accumulating h in the main kernel
# is slower (see the module docstring).
# Under the interpreter: small steps, so test shapes span several of them.
DECODE_LINEAR_CONFIG = DecodeConfig(32, 128, 4, 3, 256)
_INTERPRET_LINEAR_CONFIG = DecodeConfig(16, 16, 1, 1, 32)
_MAX_PARTS = 64  # partial intermediates each output program sums (16 KiB of L2 reads at most)


def _decode_config(n: int, device: torch.device) -> DecodeConfig:
    cfg = DECODE_LINEAR_CONFIG
    if cdiv(n, 2 * cfg.block_n) >= 1.5 * sm_count(device.index):
        cfg = cfg._replace(block_n=2 * cfg.block_n)
    return cfg


def lora_decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       down: torch.Tensor, up: torch.Tensor, scale: torch.Tensor,
                       config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ weight.T + ((x @ down.T) * scale) @ up.T + bias`` for a few tokens, rounded once.

    Two launches: a split-K shrink writes float32 partials of ``h = x @ down.T`` (one small
    program per K range), then each output program streams its columns of W, sums the partials
    in a fixed order (deterministic), and adds ``(h * scale) @ up[rn].T`` and the bias.

    Args:
        x: (T, K) activations, T <= :data:`DECODE_MAX_T`, bf16/fp16.
        weight: (N, K) base weight, bias: (N,) or None, both of x's dtype.
        down: (R, K) and up: (N, R) factors of x's dtype (several adapters concatenated along
            R, R <= 256).
        scale: (R,) float32 per-rank scale.
        config: a :class:`DecodeConfig` (or the same 5-tuple) to override
            :data:`DECODE_LINEAR_CONFIG` (whose block_n doubles for wide layers).

    Returns:
        (T, N) in x's dtype: float32 accumulation throughout (the (T, R) intermediate is never
        rounded), one rounding. Uses the Triton kernels on CUDA (or under
        ``TRITON_INTERPRET=1``) where the dtypes and strides allow and autograd is not
        recording, else :func:`lora_decode_linear_reference` (differentiable).

    Raises:
        ValueError: shapes that do not fit together, T above :data:`DECODE_MAX_T`, or a
            config whose ``shrink_k`` is not positive.
    """
    t, k = x.shape
    n = weight.shape[0]
    r = down.shape[0]
    if (weight.shape != (n, k) or down.shape != (r, k) or up.shape != (n, r)
            or scale.shape != (r,) or (bias is not None and bias.shape != (n,))):
        raise ValueError(f"lora_decode_linear: x (T, K), weight (N, K), bias (N,), down (R, K), "
                         f"up (N, R), scale (R,) expected, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {None if bias is None else tuple(bias.shape)}, "
                         f"{tuple(down.shape)}, {tuple(up.shape)}, {tuple(scale.shape)}")
    if t > DECODE_MAX_T:
        raise ValueError(f"lora_decode_linear takes at most {DECODE_MAX_T} rows, got {t}")
    if config is not None and DecodeConfig(*config).shrink_k <= 0:
        raise ValueError(f"lora_decode_linear: config shrink_k (K per partial) must be "
                         f"positive, got {DecodeConfig(*config).shrink_k}")
    tensors = (x, weight, down, up) + ((bias,) if bias is not None else ())
    interpret = interpreting()  # read once: an environment lookup costs microseconds
    usable = (triton_available() and (x.is_cuda or interpret)
              and x.dtype in _DTYPES and all(u.dtype == x.dtype for u in tensors)
              and all(u.stride(-1) == 1 for u in tensors) and t > 0 and n > 0 and k > 0
              and 0 < r <= _MAX_R
              # the kernel has no backward; the reference is differentiable
              and not (torch.is_grad_enabled() and any(u.requires_grad for u in tensors)))
    if not usable:
        return lora_decode_linear_reference(x, weight, bias, down, up, scale)

    cfg = DecodeConfig(*config) if config is not None else (
        _INTERPRET_LINEAR_CONFIG if interpret else _decode_config(n, x.device))
    bt, br = max(16, next_power_of_2(t)), max(16, next_power_of_2(r))
    step = cfg.block_k  # the shrink's K step too; each shrink program takes whole steps
    per = max(cdiv(cfg.shrink_k, step), cdiv(cdiv(k, step), _MAX_PARTS)) * step
    parts = cdiv(k, per)
    ws = torch.empty(parts * bt * br, dtype=torch.float32, device=x.device)
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    x_aligned = _aligned(x, sizes=(k,))  # both kernels read x
    with on_device_of(x):
        _kernels()[2]((parts,), x, down, ws, t, k, r, per, x.stride(0), down.stride(0),
                      BT=bt, BK=step, BR=br, IEEE=interpret,
                      ALIGNED=x_aligned and _aligned(down, sizes=()), num_warps=4)
        _kernels()[1](
            (cdiv(n, cfg.block_n),), x, weight, bias if bias is not None else out, up,
            scale.to(torch.float32).contiguous(), ws, out, t, k, n, r,
            x.stride(0), weight.stride(0), up.stride(0), out.stride(0),
            BT=bt, BK=cfg.block_k, BR=br, BN=cfg.block_n, H_PARTS=parts,
            HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, IEEE=interpret,
            ALIGNED=x_aligned and _aligned(weight, out, sizes=(n,)), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    return out
