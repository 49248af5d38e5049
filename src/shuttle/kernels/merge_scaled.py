"""Fused low-rank merge into scaled 8-bit weights, without a dense float32 weight.

The weight is ``W = Q * s`` with codes Q (M, N) in int8 or float8 and a float scale s that is
absent (float8 only), one number, or one per row. The merge computes, for each element,

    x = Q * s + sum_i scale_i * (B_i @ A_i)          (float32, B_i: (M, r_i), A_i: (r_i, N))
    s' = amax / qmax  (per row, or over the tensor; 1 where amax is 0)
    Q' = round(clamp(x / s', qmin, qmax))

with qmax = 127 for int8 and ``finfo.max`` for float8, qmin = -128 for int8 and -qmax for
float8: the representations' own ``encode`` (int8 codes reach -128 only where a scale stored in
a narrower dtype rounded down).
bitsandbytes' int8 (``absmax_scale=True``) stores the absmax itself as its scale:
``W = Q * s * fl(1/127)``, ``s' = amax`` and ``Q' = round(x * (127 / amax))``. The kernel
computes x as one fma, ``fma(Q, fl(s * dq), low-rank sum)`` (dq = 1, or fl(1/127)): one rounding
where the reference rounds ``Q * s`` (and ``* dq``) first, so x may differ from the reference's
by a float32 rounding (a code then by one step, where x / s' sits that close to a midpoint).

Two passes of one Triton kernel (``ENCODE`` off, then on), each recomputing x tile by tile from
Q and the factors (the low-rank product is cheap next to the memory traffic), one program per
(BM, BN) tile: pass 1 folds each row's amax (or the tensor's) in by atomic max; pass 2
recomputes x, derives the new scale from that amax and writes it with the codes. No host sync
and no torch op between the passes. W is never materialized:
the traffic is two reads of Q and of the factors, and one write of Q' (unscaled float8 needs
no amax: pass 2 only).

Rounding is done by hand, identically on the GPU and in the interpreter (whose float8 cast does
not round to nearest even): the spacing of the float8 grid at x is ``ulp = 2^(max(e, emin) -
mbits)`` with e the float32 exponent of x, so ``lo = floor(x / ulp) * ulp`` and ``lo + ulp`` are
exact float8 values, and the cast of the chosen one is exact (int8: ulp = 1). Nearest picks the
closer, ties to an even code; stochastic picks ``lo + ulp`` with probability ``x / ulp -
floor(x / ulp)`` (``E[Q'] = x / s'``), drawing ``hash_uniform(seed, m * N + n)``: the bits depend
on the seed and the element only, not on the tiling. Compiled nearest rounding is the hardware's
instead (float8: the conversion; int8: ``rint``; both to nearest even: the same values, in far
fewer instructions). The compiled ``x / s'`` is Triton's ``div.full`` (within 2 float32 ulps), so
a code may differ by one step from torch's where ``x / s'`` lies that close to a midpoint.

:func:`merge_scaled_reference` is the same computation in PyTorch (the oracle of the tests and
the fallback off CUDA).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from shuttle.kernels.launch import (
    cdiv,
    device_capability,
    device_floats,
    interpreting,
    seed32,
    triton_available,
)
from shuttle.kernels.merge_lowrank import padded_factors
from shuttle.kernels.rounding import Rounding, round_float

__all__ = ["ScaledMerge", "merge_scaled", "merge_scaled_or_none", "merge_scaled_reference"]

# The largest code per data dtype; the scale maps amax to it.
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,
         torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max}
# float8 grids: (mantissa bits, exponent of the smallest normal); below it the spacing stays
# that of the smallest normal binade (subnormals).
_FLOAT8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


class ScaledMerge(NamedTuple):
    """The merged weight re-encoded.

    Attributes:
        data: (M, N) new codes, of the input codes' dtype (a new tensor).
        scale: the new scale, of the input scale's shape and dtype; None when unscaled.
        amax: () float32, the largest ``|x|`` of the merged weight; not finite when any element
            is NaN or infinite (the codes and scale are then meaningless).
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    amax: torch.Tensor


def merge_scaled_reference(data: torch.Tensor, scale: torch.Tensor | None, up: torch.Tensor,
                           down: torch.Tensor, seg: list[int], scales: list[float], *,
                           absmax_scale: bool = False, rounding: Rounding = "nearest",
                           generator: torch.Generator | None = None) -> ScaledMerge:
    """:func:`merge_scaled` in PyTorch: dequantize, add the low-rank sum in float32, encode.

    Stochastic rounding draws one ``torch.rand`` of (M, N) from ``generator`` (so its bits
    differ from the kernel's; the distribution is the same).
    """
    qmax = _QMAX[data.dtype]
    x = data.float()
    if scale is not None:
        x = x * (scale.float().view(-1, 1) if scale.dim() else scale.float())
        if absmax_scale:
            x = x * _inv(qmax)
    for i, a in enumerate(scales):
        x.addmm_(up[:, seg[i]:seg[i + 1]].float(), down[seg[i]:seg[i + 1]].float(), alpha=a)
    amax_rows = x.abs().amax(dim=1)
    v, new_scale = x, None
    if scale is not None:
        new_scale, enc = _new_scale(amax_rows if scale.dim() else amax_rows.amax(), scale.dtype,
                                    qmax, absmax_scale)
        enc = enc.view(-1, 1) if scale.dim() else enc
        v = x * enc if absmax_scale else x / enc
    v = v.clamp(_qmin(data.dtype), qmax)
    if data.dtype.is_floating_point:
        codes = round_float(v, data.dtype, rounding, generator)
    elif rounding == "nearest":
        codes = torch.round(v).to(data.dtype)
    else:
        lo = v.floor()
        u = torch.rand(v.shape, generator=generator, device=v.device)
        codes = (lo + (u < v - lo).float()).to(data.dtype)
    return ScaledMerge(codes, new_scale, amax_rows.amax())


def _qmin(dtype: torch.dtype) -> float:
    """The smallest code: -128 for int8 (``absmax_encode`` clamps to iinfo), -max for float8."""
    return -128.0 if dtype == torch.int8 else -_QMAX[dtype]


@functools.cache  # a torch op and a read back: several microseconds of host time a call
def _inv(qmax: float) -> float:
    """``1 / qmax`` rounded to float32: bitsandbytes multiplies by it (7.874015718698502e-3)."""
    return torch.tensor(1.0 / qmax, dtype=torch.float32).item()


def _new_scale(amax: torch.Tensor, dtype: torch.dtype, qmax: float, absmax_scale: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stored scale, float32 encode operand)`` from the float32 ``amax``.

    Scaled: ``s' = amax / qmax`` (1 for a zero amax: any scale encodes zeros) stored in
    ``dtype``, and codes are ``x / s'`` with the scale as stored. ``absmax_scale``: the absmax
    itself is stored (0 stays 0) and codes are ``x * (qmax / amax)``.
    """
    one = torch.ones_like(amax)
    if absmax_scale:
        return amax.to(dtype), qmax / torch.where(amax > 0, amax, one)
    stored = torch.where(amax > 0, amax / qmax, one).to(dtype)
    return stored, stored.float()


# Shared tile helpers, bound by tiles.bind_tiles() when the kernels are built (see there).
hash_uniform = lowrank_tile = round_bf16 = tile_of = None
libdevice = None  # triton.language.extra.libdevice, bound by _kernel() (Triton is optional)


@functools.cache
def _kernel():
    global libdevice
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from shuttle.kernels.tiles import bind_tiles

    bind_tiles(globals(), "hash_uniform", "lowrank_tile", "round_bf16", "tile_of")

    @triton.jit
    def merge_scaled_kernel(
            q_ptr, s_ptr, b_ptr, a_ptr, scales_ptr, out_ptr, new_s_ptr, stats_ptr, seed, M, N,
            stride_qm, stride_bm, stride_ar, dq, ENCODE: tl.constexpr, QMIN: tl.constexpr,
            QMAX: tl.constexpr, INV_QMAX: tl.constexpr, SCALE: tl.constexpr,
            MUL: tl.constexpr, INT: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
            STOCHASTIC: tl.constexpr,
            HW_ROUND: tl.constexpr, N_SEG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BR: tl.constexpr, IEEE: tl.constexpr):
        # One (BM, BN) tile of x per program in both passes. stats (float32, M + 2, zeroed):
        # [0, M) the rows' max |x| (per-row scale), [M] the tensor's (per-tensor scale), both
        # folded in by pass 1 (ENCODE False) with atomic max; [M + 1] the merged weight's
        # max |x| (for the finiteness check): pass 2 (ENCODE True) copies pass 1's, or
        # computes it when unscaled (no pass 1). Pass 2 derives the new scale from pass 1's
        # amax (programs of the first tile column store it) and writes the codes. SCALE: 0
        # none, 1 per tensor, 2 per row; the factors are zero-padded to BR ranks per
        # contribution, as in merge_lowrank. (Pass 1 as one program per row block walking the
        # columns is latency-bound, and programs walking rows are slower.)
        pid = tl.program_id(0)
        rm, rn, mask_m, mask_n = tile_of(pid, M, N, BM, BN)
        mask = mask_m[:, None] & mask_n[None, :]
        # x = fma(Q, s * dq, sum_s scale_s * b_s @ a_s), float32; 0 outside (M, N). Spelled
        # so that the compiler moves the codes (8-bit, or float16 for int8: exact for
        # |q| <= 128) into the tensor cores' accumulator layout, not the float32 tile: a
        # quarter (a half) of the bytes through shared memory. Its layout pass hoists that
        # conversion above an extension op feeding one fma with broadcast operands, not above
        # a multiply by a broadcast row scale; and it keeps the row max in that layout when
        # the max keeps its dims and feeds 2-D pointers (a 1-D row max made it convert x back).
        acc = lowrank_tile(b_ptr, a_ptr, scales_ptr, rm, rn, mask_m, mask_n, stride_bm,
                           stride_ar, BM, BN, N_SEG, BR, IEEE)
        q = tl.load(q_ptr + rm[:, None] * stride_qm + rn[None, :], mask=mask, other=0.0)
        qf = q.to(tl.float16).to(tl.float32) if INT else q.to(tl.float32)
        if SCALE == 0:
            x = tl.fma(qf, dq, acc)
        elif SCALE == 1:
            x = tl.fma(qf, tl.load(s_ptr).to(tl.float32) * dq, acc)
        else:
            s_rows = tl.load(s_ptr + rm, mask=mask_m, other=0.0).to(tl.float32)
            x = tl.fma(qf, (s_rows * dq)[:, None], acc)
        if not ENCODE or SCALE == 0:
            # (BM, 1); NaN counts as inf, so that a max propagates any non-finite element
            amax = tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=1, keep_dims=True)
        if not ENCODE:
            if SCALE == 1:
                tl.atomic_max(stats_ptr + M, tl.max(tl.max(amax, axis=1), axis=0))
            else:
                tl.atomic_max(stats_ptr + rm[:, None], amax, mask=mask_m[:, None])
        else:
            v = x
            if SCALE > 0:
                # The new scale (see _new_scale): s' = amax / qmax (1 for a zero amax) rounded
                # to the scale's dtype, codes x / s'; bitsandbytes' form stores the absmax and
                # codes are x * (qmax / amax). Each spelled as torch computes it on the
                # device the representations encode on, so that the scales agree to the bit.
                if SCALE == 1:
                    a = tl.load(stats_ptr + M)
                else:
                    a = tl.load(stats_ptr + rm, mask=mask_m, other=0.0)
                if MUL:  # torch: qmax / t is reciprocal(t) * qmax
                    stored = a
                    enc = tl.math.div_rn(1.0, tl.where(a > 0, a, 1.0)) * QMAX
                elif INV_QMAX > 0:  # torch on CUDA: t / scalar is t * fl32(1 / scalar)
                    stored = tl.where(a > 0, a * INV_QMAX, 1.0)
                else:  # torch on the CPU: a correctly rounded division
                    stored = tl.where(a > 0, tl.math.div_rn(a, QMAX), 1.0)
                if new_s_ptr.dtype.element_ty == tl.bfloat16:
                    stored = round_bf16(stored)
                else:
                    stored = stored.to(new_s_ptr.dtype.element_ty)
                if not MUL:
                    enc = stored.to(tl.float32)
                if SCALE == 1:
                    if pid == 0:
                        tl.store(new_s_ptr, stored)
                        # pass 1's amax is the merged weight's (the finiteness check's)
                        tl.store(stats_ptr + M + 1, a)
                    v = x * enc if MUL else x / enc
                else:
                    if pid % tl.cdiv(N, BN) == 0:
                        tl.store(new_s_ptr + rm, stored, mask=mask_m)
                        tl.atomic_max(stats_ptr + M + 1, tl.max(a, axis=0))
                    v = x * enc[:, None] if MUL else x / enc[:, None]
            v = tl.minimum(tl.maximum(v, QMIN), QMAX)
            if HW_ROUND:
                # nearest, compiled: the hardware rounds to nearest even (float8: the
                # conversion; int8: rint, as torch.round)
                code = libdevice.rint(v) if INT else v
            else:
                if INT:
                    t = v
                else:
                    # ulp = 2^(max(e, EMIN) - MBITS) with e v's float32 exponent, built from
                    # bits; t = v / ulp is exact (a power of two), so are floor(t) * ulp and
                    # one ulp more: both are float8 values, and their casts exact.
                    ex = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
                    ex = tl.maximum(ex, EMIN) - MBITS
                    ulp = ((ex + 127) << 23).to(tl.float32, bitcast=True)
                    t = v * ((127 - ex) << 23).to(tl.float32, bitcast=True)
                f = tl.floor(t)
                frac = t - f
                if STOCHASTIC:  # the element's flat index: the same bits for any tiling
                    up = hash_uniform(seed, rm.to(tl.int64)[:, None] * N + rn[None, :]) < frac
                else:  # ties to an even code: f's parity is that of the last mantissa bit
                    up = (frac > 0.5) | ((frac == 0.5) & ((f.to(tl.int32) & 1) == 1))
                code = f + up.to(tl.float32)
                if not INT:
                    # keep the sign of zeros, as torch's cast does (-tiny rounds to -0.0)
                    sign = v.to(tl.uint32, bitcast=True) & 0x80000000
                    code = ((code * ulp).to(tl.uint32, bitcast=True) | sign).to(
                        tl.float32, bitcast=True)
            tl.store(out_ptr + rm[:, None] * N + rn[None, :],
                     code.to(out_ptr.dtype.element_ty), mask=mask)
            if SCALE == 0:
                tl.atomic_max(stats_ptr + M + 1, tl.max(tl.max(amax, axis=1), axis=0))

    return merge_scaled_kernel


# (BM, BN, num_warps) on CUDA per pass (pass 1: the amax; pass 2: the encode): the fastest GPU
# time in benchmarks/quantized.py --sweep (fp8 row-wise 12288x3072, rank 64;
# docs/benchmarks/quantized_merge_sweep.md).
CUDA_CONFIG: tuple[int, int, int] = (64, 128, 4)
CUDA_CONFIG_ENCODE: tuple[int, int, int] = (64, 128, 4)


def merge_scaled(data: torch.Tensor, scale: torch.Tensor | None, up: torch.Tensor,
                 down: torch.Tensor, seg: list[int], scales: list[float], *,
                 absmax_scale: bool = False, rounding: Rounding = "nearest", seed: int = 0,
                 config: tuple[int, int, int] | None = None) -> ScaledMerge:
    """Merge ``sum_i scale_i * up[:, seg_i] @ down[seg_i]`` into scaled 8-bit codes, re-encoded.

    Args:
        data: (M, N) int8, float8_e4m3fn or float8_e5m2 codes, unit stride along N; not changed.
        scale: None (float8 only: values clamp to ``±finfo.max``), a () scale or an (M,) one per
            row; float32, bfloat16 or float16 (the new scale is stored in it, and codes are
            divided by the scale as stored).
        up: (M, R) concatenated up factors; down: (R, N), same dtype (bf16, fp16 or fp32).
        seg: R-offsets of the contributions, ``[0, r_1, r_1 + r_2, ..., R]``.
        scales: the scale of each contribution (strength x alpha / rank).
        absmax_scale: bitsandbytes' int8 form: ``scale`` holds each row's absmax.
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased).
        seed: drives stochastic rounding (repeatable per seed, independent of ``config``).
        config: ``(BM, BN, num_warps)`` for both passes, to override :data:`CUDA_CONFIG` and
            :data:`CUDA_CONFIG_ENCODE` (each a power of two, BM and BN at least 16).

    Returns:
        A :class:`ScaledMerge` of new tensors. Runs the Triton kernels where Triton is installed
        and ``data`` is on CUDA (or under ``TRITON_INTERPRET=1``), else
        :func:`merge_scaled_reference` with a generator seeded by ``seed``.
    """
    assert data.dim() == up.dim() == down.dim() == 2, "merge_scaled works on 2-D views"
    assert up.shape == (data.shape[0], seg[-1]) and down.shape == (seg[-1], data.shape[1])
    assert len(seg) == len(scales) + 1 and data.dtype in _QMAX
    assert scale is not None or data.dtype.is_floating_point, "int8 codes need a scale"
    assert scale is None or scale.shape in ((), data.shape[:1]), "scale: () or (M,)"
    assert scale is None or scale.dtype in _SCALE_DTYPES, "scale: float32, bfloat16 or float16"
    interpret = interpreting()
    if not triton_available() or not (data.is_cuda or interpret) or data.stride(1) != 1:
        g = torch.Generator(device=data.device).manual_seed(seed)
        return merge_scaled_reference(data, scale, up, down, seg, scales,
                                      absmax_scale=absmax_scale, rounding=rounding, generator=g)

    kernel = _kernel()
    up_p, down_p, scales, br = padded_factors(up, down, seg, scales)
    m, n = data.shape
    qmax = _QMAX[data.dtype]
    scales_t = device_floats(scales, data.device)
    granularity = 0 if scale is None else 1 if scale.dim() == 0 else 2
    dq = _inv(qmax) if absmax_scale and scale is not None else 1.0
    mbits, emin = _FLOAT8_GRID.get(data.dtype, (0, 0))  # int8 ignores them
    out = torch.empty(m, n, dtype=data.dtype, device=data.device)
    stats = torch.zeros(m + 2, dtype=torch.float32, device=data.device)
    new_scale = None
    if scale is not None:
        scale = scale.contiguous()  # the kernel indexes a per-row scale with unit stride
        new_scale = torch.empty_like(scale)
    stochastic = rounding == "stochastic"
    hw_round = not stochastic and not interpret

    def launch(encode: bool) -> None:
        # Unused pointers (no scale; pass 1's new scale) are given any tensor: never read.
        bm, bn, warps = config or ((16, 16, 1) if interpret else
                                   CUDA_CONFIG_ENCODE if encode else CUDA_CONFIG)
        kernel[(cdiv(m, bm) * cdiv(n, bn),)](
            data, stats if scale is None else scale, up_p, down_p, scales_t, out,
            stats if new_scale is None else new_scale, stats, seed32(seed), m, n,
            data.stride(0), up_p.stride(0), down_p.stride(0), dq, ENCODE=encode,
            QMIN=_qmin(data.dtype), QMAX=qmax, INV_QMAX=0.0 if interpret else _inv(qmax),
            SCALE=granularity, MUL=absmax_scale,
            INT=data.dtype == torch.int8, MBITS=mbits, EMIN=emin, STOCHASTIC=stochastic,
            HW_ROUND=hw_round, N_SEG=len(scales), BM=bm, BN=bn, BR=br,
            IEEE=up.dtype == torch.float32 or interpret, num_warps=warps, num_stages=1)

    if scale is not None:
        launch(False)
    launch(True)
    return ScaledMerge(out, new_scale, stats[m + 1])


_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def merge_scaled_or_none(data: torch.Tensor, scale: torch.Tensor | None, up: torch.Tensor,
                         down: torch.Tensor, seg: list[int], scales: list[float], *,
                         absmax_scale: bool = False, rounding: Rounding = "nearest",
                         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """:func:`merge_scaled` for a representation's ``merge_lowrank``: ``(codes, scale)`` in the
    given tensors' shapes and dtypes, or None where the kernel does not apply.

    ``data`` may have any number of dims (rows first; ``up`` has a row per ``data.shape[0]``
    and ``down`` a column per element of a row). ``scale`` may have any shape that is one
    number, or one per row broadcast over the other dims (``(rows,)``, ``(rows, 1)``).

    None when: Triton is missing, ``data`` is neither on CUDA nor interpreted, not contiguous,
    or of another dtype, or float8 on a GPU older than sm89; the scale has another
    granularity or a dtype other than float32/bfloat16/float16; or the merged weight is not
    finite (this check syncs with the device once; the caller's float32 path then reports the
    error).
    """
    rows = data.shape[0]
    if not (triton_available() and (data.is_cuda or interpreting()) and data.is_contiguous()
            and data.dtype in _QMAX):
        return None
    if data.is_cuda and data.dtype != torch.int8 and (
            device_capability(data.device) < (8, 9)):
        return None  # Triton converts float8 only on sm89+ (Ada, Hopper and later)
    s = scale
    if scale is not None:
        if scale.dtype not in _SCALE_DTYPES:
            return None
        if scale.numel() == 1:
            s = scale.reshape(())
        elif scale.dim() >= 1 and scale.shape[0] == rows and scale.numel() == rows:
            s = scale.reshape(rows)
        else:
            return None
    out = merge_scaled(data.view(rows, -1), s, up, down, seg, scales, absmax_scale=absmax_scale,
                       rounding=rounding, seed=seed)
    if not math.isfinite(out.amax.item()):  # the one host sync (no isfinite kernel)
        return None
    return out.data.view(data.shape), None if scale is None else out.scale.view(scale.shape)

