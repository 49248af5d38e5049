"""The rank-sized products of a LoRA backward for up to three projections of one input (q, k
and v), each in one launch.

For projections ``i`` with output gradients ``dy_i`` (T, N_i), factors ``B_i`` (N_i, r_i),
scales ``s_i`` and the forward's shrink ``hx`` (T, sum r), whose columns ``c_i : c_i + r_i``
belong to projection ``i``:

    u_i  = s_i * dy_i B_i              (T, r_i)   into columns c_i of one (T, sum r) buffer
    dB_i = s_i * dy_i^T hx[:, c_i]     (N_i, r_i)

With cuBLAS each is one GEMM per projection, six launches for q, k and v; here
:func:`lora_grad_u` and :func:`lora_grad_b` launch once each, their grids spanning the
projections. Products accumulate in float32 from operands in ``dy``'s dtype (the factors
are cast as they are loaded); ``u`` is rounded once to ``dy``'s dtype, ``dB`` stored in the
parameters' dtype unrounded. :func:`lora_grad_u_reference` and :func:`lora_grad_b_reference`
are the same math in PyTorch (the fallback off CUDA and under ``torch.compile``, and the
oracle of the tests).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from shuttle.kernels.launch import (
    CompiledLaunch,
    cdiv,
    interpreting,
    next_power_of_2,
    triton_available,
)

__all__ = ["lora_grad_b", "lora_grad_b_reference", "lora_grad_u", "lora_grad_u_reference",
           "takes_lora_grads"]

MAX_PROJECTIONS = 3
_BT_U, _BN_U = 64, 64  # u: rows of a program, columns of dy per step of its loop
_BN_B, _BT_B = 32, 128  # dB: rows of dB (columns of dy) of a program, rows of dy per step


# -- references ------------------------------------------------------------------------------

def lora_grad_u_reference(dys: Sequence[torch.Tensor], bs: Sequence[torch.Tensor],
                          scales: Sequence[float], u_all: torch.Tensor) -> torch.Tensor:
    """``u_all[:, c_i : c_i + r_i] = s_i * dy_i B_i`` for each ``i``; ``u_all`` returned."""
    at = 0
    for dy, b, s in zip(dys, bs, scales, strict=True):
        r = b.shape[1]
        u = u_all[:, at:at + r]
        torch.addmm(u, dy, b.to(dy.dtype), beta=0, alpha=s, out=u)
        at += r
    return u_all


def lora_grad_b_reference(dys: Sequence[torch.Tensor], hx: torch.Tensor,
                          scales: Sequence[float], ranks: Sequence[int],
                          dtype: torch.dtype) -> list[torch.Tensor]:
    """``[s_i * dy_i^T hx[:, c_i : c_i + r_i] in dtype]``: float32 products (float64 for
    float64 operands), one rounding.
    """
    out, at = [], 0
    for dy, s, r in zip(dys, scales, ranks, strict=True):
        wide = torch.promote_types(dy.dtype, torch.float32)
        out.append((dy.T.to(wide) @ hx[:, at:at + r].to(wide)).mul_(s).to(dtype))
        at += r
    return out


# -- the kernels -----------------------------------------------------------------------------

@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # Launched by CompiledLaunch (the host is what bounds a LoRA step, and Triton's own
    # dispatch costs about as much as a cuBLAS call): every runtime argument unspecialized.
    # The projections' sizes are picked by a branch on the program, so they could not be
    # constants anyway (Triton would make a size of 1 one, and the branches' types differ).
    # ALIGNED: the rows of every dy start on 16 bytes (vector loads of dy); IEEE: the
    # interpreter, whose bf16 dot is wrong (float32 operands there).
    sizes = [f"{a}{i}" for a in ("n", "r", "c", "s", "stride_dy") for i in range(3)]
    u_runtime = [f"{a}{i}" for a in ("dy", "b") for i in range(3)] + sizes + [
        "u_ptr", "T", "stride_u"]
    b_runtime = [f"{a}{i}" for a in ("dy", "g") for i in range(3)] + sizes + [
        "hx_ptr", "T", "stride_hx"]

    @triton.jit(do_not_specialize=u_runtime)
    def lora_grad_u_kernel(dy0, dy1, dy2, b0, b1, b2, n0, n1, n2, r0, r1, r2, c0, c1, c2,
                           s0, s1, s2, stride_dy0, stride_dy1, stride_dy2, u_ptr, T, stride_u,
                           BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                           ALIGNED: tl.constexpr, IEEE: tl.constexpr):
        p = tl.program_id(1)
        if p == 0:
            dy, b, n, r, c, s, sd = dy0, b0, n0, r0, c0, s0, stride_dy0
        elif p == 1:
            dy, b, n, r, c, s, sd = dy1, b1, n1, r1, c1, s1, stride_dy1
        else:
            dy, b, n, r, c, s, sd = dy2, b2, n2, r2, c2, s2, stride_dy2
        if ALIGNED:
            dy = tl.multiple_of(dy, 16)
            sd = tl.multiple_of(sd, 8)
        rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        cols = tl.arange(0, BR)
        acc = tl.zeros((BT, BR), dtype=tl.float32)
        for k0 in range(0, n, BN):
            ks = k0 + tl.arange(0, BN)
            d = tl.load(dy + rows[:, None] * sd + ks[None, :],
                        mask=(rows[:, None] < T) & (ks[None, :] < n), other=0.0)
            f = tl.load(b + ks[:, None] * r + cols[None, :],
                        mask=(ks[:, None] < n) & (cols[None, :] < r), other=0.0)
            if IEEE:
                if f.dtype == tl.float32 and d.dtype == tl.bfloat16:
                    # the interpreter's float32 -> bf16 does not round to nearest even: the
                    # rounded value, kept in float32
                    bits = f.to(tl.uint32, bitcast=True)
                    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                    f = bits.to(tl.float32, bitcast=True)
                else:
                    f = f.to(d.dtype).to(tl.float32)
                acc = tl.dot(d.to(tl.float32), f, acc, input_precision="ieee")
            else:
                acc = tl.dot(d, f.to(d.dtype), acc)
        acc = acc * s
        tl.store(u_ptr + rows[:, None] * stride_u + (c + cols)[None, :],
                 acc.to(u_ptr.dtype.element_ty), mask=(rows[:, None] < T) & (cols[None, :] < r))

    @triton.jit(do_not_specialize=b_runtime)
    def lora_grad_b_kernel(dy0, dy1, dy2, g0, g1, g2, n0, n1, n2, r0, r1, r2, c0, c1, c2,
                           s0, s1, s2, stride_dy0, stride_dy1, stride_dy2, hx_ptr, T, stride_hx,
                           BN: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr,
                           ALIGNED: tl.constexpr, IEEE: tl.constexpr):
        p = tl.program_id(1)
        if p == 0:
            dy, g, n, r, c, s, sd = dy0, g0, n0, r0, c0, s0, stride_dy0
        elif p == 1:
            dy, g, n, r, c, s, sd = dy1, g1, n1, r1, c1, s1, stride_dy1
        else:
            dy, g, n, r, c, s, sd = dy2, g2, n2, r2, c2, s2, stride_dy2
        if ALIGNED:
            dy = tl.multiple_of(dy, 16)
            sd = tl.multiple_of(sd, 8)
        ns = tl.program_id(0) * BN + tl.arange(0, BN)
        cols = tl.arange(0, BR)
        if tl.program_id(0) * BN < n:  # the grid spans the widest projection
            acc = tl.zeros((BN, BR), dtype=tl.float32)
            for t0 in range(0, T, BT):
                ts = (t0 + tl.arange(0, BT)).to(tl.int64)
                d = tl.load(dy + ts[:, None] * sd + ns[None, :],
                            mask=(ts[:, None] < T) & (ns[None, :] < n), other=0.0)
                h = tl.load(hx_ptr + ts[:, None] * stride_hx + (c + cols)[None, :],
                            mask=(ts[:, None] < T) & (cols[None, :] < r), other=0.0)
                if IEEE:
                    acc = tl.dot(tl.trans(d).to(tl.float32), h.to(tl.float32), acc,
                                 input_precision="ieee")
                else:
                    acc = tl.dot(tl.trans(d), h, acc)
            acc = acc * s
            tl.store(g + ns[:, None] * r + cols[None, :], acc.to(g.dtype.element_ty),
                     mask=(ns[:, None] < n) & (cols[None, :] < r))

    return CompiledLaunch(lora_grad_u_kernel), CompiledLaunch(lora_grad_b_kernel)


def takes_lora_grads(dys: Sequence[torch.Tensor | None], factors: Sequence[torch.Tensor]
                     ) -> bool:
    """Whether :func:`lora_grad_u` and :func:`lora_grad_b` launch their kernels for these
    gradients and factors (else they run the references): CUDA (or Triton's interpreter),
    1 to 3 projections, every ``dy`` present, row-major, bf16/fp16 and of one dtype, the
    factors of one float dtype and rank at most 128.
    """
    if not dys or len(dys) > MAX_PROJECTIONS or torch.compiler.is_compiling() \
            or not triton_available():
        return False
    d0 = dys[0]
    if d0 is None or not (d0.is_cuda or interpreting()) \
            or d0.dtype not in (torch.bfloat16, torch.float16):
        return False
    f0 = factors[0]
    return (all(d is not None and d.dtype == d0.dtype and d.stride(1) == 1 for d in dys)
            and all(f.dtype == f0.dtype and f.is_contiguous() for f in factors)
            and f0.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and max(f.shape[-1] for f in factors) <= 128)


def _aligned(dys: Sequence[torch.Tensor]) -> bool:
    """Whether every row of every ``dy`` starts on 16 bytes."""
    return all(d.data_ptr() % 16 == 0 and d.stride(0) * d.element_size() % 16 == 0
               for d in dys)


def _pad(items: list, n: int) -> list:
    return items + [items[0]] * (n - len(items))


def lora_grad_u(dys: Sequence[torch.Tensor], bs: Sequence[torch.Tensor],
                scales: Sequence[float], u_all: torch.Tensor) -> torch.Tensor:
    """``u_all[:, c_i : c_i + r_i] = s_i * dy_i B_i`` for each projection ``i`` (``dy_i``
    (T, N_i), ``B_i`` (N_i, r_i), ``u_all`` (T, sum r) in ``dy``'s dtype); ``u_all`` returned.
    One launch where :func:`takes_lora_grads`, else the reference.
    """
    if not takes_lora_grads(dys, bs) or u_all.stride(1) != 1 or u_all.shape[0] == 0:
        return lora_grad_u_reference(dys, bs, scales, u_all)
    n = len(dys)
    ranks = [b.shape[1] for b in bs]
    cols = [sum(ranks[:i]) for i in range(n)]
    t = u_all.shape[0]
    interpret = interpreting()
    _kernels()[0](
        (cdiv(t, _BT_U), n), *_pad(list(dys), 3), *_pad(list(bs), 3),
        *_pad([b.shape[0] for b in bs], 3), *_pad(ranks, 3), *_pad(cols, 3),
        *_pad([float(s) for s in scales], 3), *_pad([d.stride(0) for d in dys], 3), u_all, t,
        u_all.stride(0), BT=_BT_U, BN=16 if interpret else _BN_U,
        BR=max(16, next_power_of_2(max(ranks))), ALIGNED=_aligned(dys), IEEE=interpret,
        num_warps=4, num_stages=3)
    return u_all


def lora_grad_b(dys: Sequence[torch.Tensor], hx: torch.Tensor, scales: Sequence[float],
                ranks: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """``[s_i * dy_i^T hx[:, c_i : c_i + r_i] in dtype]`` (N_i, r_i) for each projection
    ``i``, from float32 accumulators (``hx`` (T, sum r) in ``dy``'s dtype). One launch where
    :func:`takes_lora_grads`, else the reference.
    """
    outs = [hx.new_empty(d.shape[1], r, dtype=dtype) for d, r in zip(dys, ranks, strict=True)]
    if not takes_lora_grads(dys, outs) or hx.stride(1) != 1 or hx.dtype != dys[0].dtype \
            or hx.shape[0] == 0:
        return lora_grad_b_reference(dys, hx, scales, ranks, dtype)
    n = len(dys)
    cols = [sum(ranks[:i]) for i in range(n)]
    widths = [d.shape[1] for d in dys]
    interpret = interpreting()
    _kernels()[1](
        (cdiv(max(widths), _BN_B), n), *_pad(list(dys), 3), *_pad(outs, 3), *_pad(widths, 3),
        *_pad(list(ranks), 3), *_pad(cols, 3), *_pad([float(s) for s in scales], 3),
        *_pad([d.stride(0) for d in dys], 3), hx, hx.shape[0], hx.stride(0),
        BN=_BN_B, BT=16 if interpret else _BT_B, BR=max(16, next_power_of_2(max(ranks))),
        ALIGNED=_aligned(dys), IEEE=interpret, num_warps=4, num_stages=3)
    return outs
