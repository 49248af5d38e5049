"""Fused low-rank merge: ``W <- round(W + sum_i alpha_i * B_i @ A_i)`` with one rounding.

W is (M, N) in bf16/fp16/fp32; the factors of all contributions are concatenated along the rank:
B (M, R) and A (R, N), with contribution i owning ranks ``seg[i]:seg[i+1]`` and scale
``alpha[i]``. Each program loads one (BM, BN) tile of W once, accumulates every contribution's
product in float32 (the products of bf16/fp16 factors are exact in float32), adds, rounds once
and stores: W is read once and written once, which makes the merge memory-bound at about the
device's copy bandwidth. cuBLAS's in-place ``addmm_`` on bf16 does not give this: it rounds the
scaled product to bf16 before adding it to W (measured, docs/benchmarks/merge.md).

:func:`merge_lowrank_reference` is the same computation in PyTorch, used as the fallback and as
the oracle the kernel is tested against (on CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from shuttle.kernels.launch import (
    bind_tiles,
    cdiv,
    device_floats,
    interpreting,
    next_power_of_2,
    on_device_of,
    triton_available,
)

__all__ = ["LowRankJob", "merge_lowrank", "merge_lowrank_many", "merge_lowrank_reference",
           "overflow_margin", "padded_factors"]


def merge_lowrank_reference(w: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                            seg: list[int], alpha: list[float]) -> None:
    """``w += sum_i alpha_i * up[:, seg_i] @ down[seg_i]`` in float32, rounded once, in place."""
    acc = w.float()
    for i, a in enumerate(alpha):
        r0, r1 = seg[i], seg[i + 1]
        acc.addmm_(up[:, r0:r1].float(), down[r0:r1].float(), alpha=a)
    w.copy_(acc)


# Shared tile helpers, bound by bind_tiles() when the kernels are built (see there).
lowrank_tile = pick = store_rne = tile_of = None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    bind_tiles(globals(), "lowrank_tile", "pick", "store_rne", "tile_of")

    @triton.jit
    def merge_kernel(ws, bs, as_, alphas, flag_ptr, M, N, stride_wm, stride_bm, stride_ar,
                     G: tl.constexpr, N_SEG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BR: tl.constexpr, IEEE: tl.constexpr, OVERFLOW: tl.constexpr):
        # Job j = program_id(1) of G (tuples of G pointers: weights w (M, N), factors b
        # (M, N_SEG * BR) and a (N_SEG * BR, N), scales (N_SEG,)); every job of one launch
        # has the same shapes and strides. Contribution s owns ranks s*BR ... (s+1)*BR,
        # zero-padded, so rank offsets are compile-time multiples of BR (aligned vector loads,
        # no rank masks). One (BM, BN) tile of W per program, and many programs per SM: the
        # W load is issued first, so its latency hides behind the factor loads and the dot,
        # and other programs' loads fill the gaps. (A persistent loop over tiles measured
        # 2-3x slower: the tiles' loads were not overlapped.)
        j = tl.program_id(1)
        w_ptr, b_ptr = pick(ws, j, G), pick(bs, j, G)
        a_ptr, alpha_ptr = pick(as_, j, G), pick(alphas, j, G)
        rm, rn, mask_m, mask_n = tile_of(tl.program_id(0), M, N, BM, BN)
        mask = mask_m[:, None] & mask_n[None, :]
        ptrs = w_ptr + rm[:, None] * stride_wm + rn[None, :]
        w = tl.load(ptrs, mask=mask, other=0.0)
        acc = lowrank_tile(b_ptr, a_ptr, alpha_ptr, rm, rn, mask_m, mask_n, stride_bm, stride_ar,
                           BM, BN, N_SEG, BR, IEEE)
        x = w.to(tl.float32) + acc
        store_rne(ptrs, x, mask)
        if OVERFLOW > 0:
            # a finite sum that rounds to infinity (float16: |x| >= 65520): flag it, by one
            # store per tile after a tile-wide max (a masked store per element measured
            # 73 us a 12288x3072 weight, this 54, none 44: benchmarks/tune_merge_kernel.py)
            bad = mask & (tl.abs(x) >= OVERFLOW) & (tl.abs(x) < float("inf"))
            if tl.max(bad.to(tl.int32)) > 0:
                tl.store(flag_ptr, 1)

    return merge_kernel


# (BM, BN, num_warps) on CUDA; chosen by benchmarks/tune_merge_kernel.py on an H200 (the
# configurations within a few percent of each other run to run). A variant moving the tiles by
# TMA measured 25-35% slower in two runs (docs/benchmarks/merge_kernel_tuning.md) and was dropped.
CUDA_CONFIG: tuple[int, int, int] = (64, 128, 8)
# The most weights one launch merges (benchmarks/merge.py --max-group): a whole-model merge
# launches once per group of same-shaped weights, not once per weight, so that the host's
# Python and launch time per weight stays below the GPU's.
MAX_GROUP = 8
_MAX_RANK_STEP = 128  # larger ranks are split into several contributions of at most this
_RANK_STEPS = (16, 32, 64, 128)  # ranks used as they are (seg [0, r], one contribution)
# The smallest |x| that rounds (to nearest even) to infinity in each weight dtype: halfway from
# the largest finite value to the next power of two, where the tie goes to the even infinity.
_OVERFLOW = {torch.float16: 65520.0, torch.bfloat16: 2.0**128 - 2.0**119}


# How far beyond the largest finite value a sum may go and still round to it.
_MARGIN = {dtype: threshold - torch.finfo(dtype).max for dtype, threshold in _OVERFLOW.items()}


def overflow_margin(dtype: torch.dtype) -> float | None:
    """How far beyond the largest finite value of ``dtype`` a sum may go and still round to it
    (float16: 16, bfloat16: 2**119): an update bounded below this cannot overflow a finite
    weight, and needs no overflow flag. None for dtypes the kernel does not flag (float32).
    """
    return _MARGIN.get(dtype)


class LowRankJob(NamedTuple):
    """One weight's merge for :func:`merge_lowrank_many`:
    ``w += sum_i alpha[i] * up[:, seg[i]:seg[i+1]] @ down[seg[i]:seg[i+1]]``.
    """

    w: torch.Tensor  # (M, N), unit stride along N
    up: torch.Tensor  # (M, R), unit stride along R
    down: torch.Tensor  # (R, N), unit stride along N; the dtype of up
    seg: list[int]  # R-offsets of the contributions, [0, r_1, r_1 + r_2, ..., R]
    alpha: list[float]  # the scale of each contribution (strength x alpha / rank)
    overflow: torch.Tensor | None = None  # see merge_lowrank


def merge_lowrank(w: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  seg: list[int], alpha: list[float],
                  config: tuple[int, int, int] | None = None,
                  overflow: torch.Tensor | None = None) -> None:
    """In place: ``w += sum_i alpha_i * up[:, seg_i] @ down[seg_i]``, float32 sum, one rounding.

    Args:
        w: (M, N) weight, unit stride along N.
        up: (M, R) concatenated up factors, unit stride along R.
        down: (R, N) concatenated down factors, unit stride along N; same dtype as ``up``.
        seg: R-offsets of the contributions, ``[0, r_1, r_1 + r_2, ..., R]``.
        alpha: the scale of each contribution (strength x alpha / rank).
        config: ``(BM, BN, num_warps)`` to override :data:`CUDA_CONFIG`.
        overflow: a one-element int32 tensor on ``w``'s device, set to 1 where a finite
            sum rounds to infinity (float16: |x| >= 65520; bfloat16 near 3.4e38); for the
            caller to read when it syncs anyway (no host sync here).

    Uses the Triton kernel where Triton is installed and the tensors are on CUDA (or under
    ``TRITON_INTERPRET=1``), else :func:`merge_lowrank_reference`.
    """
    merge_lowrank_many([LowRankJob(w, up, down, seg, alpha, overflow)], config)


def merge_lowrank_many(jobs: Sequence[LowRankJob],
                       config: tuple[int, int, int] | None = None) -> None:
    """:func:`merge_lowrank` for every job, one launch per group of up to :data:`MAX_GROUP`
    jobs of the same shapes, strides and dtypes (a model's layers repeat a few shapes).

    The results equal one :func:`merge_lowrank` per job bit for bit: the same tiles, the same
    arithmetic. Where two jobs' weights overlap in memory (row ranges of one weight that
    overlap) every job is merged alone, in order. Padded factors (several contributions) are
    made for the launch and freed after it, in stream order.
    """
    interpret = interpreting()
    items = []  # (what the kernel is specialized on or takes as scalars, one job's tensors)
    for job in jobs:
        w, up, down, seg, alpha, overflow = job
        assert w.dim() == up.dim() == down.dim() == 2, "merge_lowrank works on 2-D views"
        assert up.shape[1] == down.shape[0] == seg[-1] and len(seg) == len(alpha) + 1
        if not triton_available() or not (w.is_cuda or interpret) or w.stride(1) != 1:
            _merge_reference(job)
            continue
        if not w.numel():
            continue
        up_p, down_p, alpha, br = padded_factors(up, down, seg, alpha)
        key = (w.device, w.dtype, up_p.dtype, w.shape, w.stride(0), up_p.stride(0),
               down_p.stride(0), len(alpha), br, None if overflow is None else id(overflow))
        items.append((key, (w, up_p, down_p, device_floats(alpha, w.device), overflow)))
    if len(items) > 1 and _overlapping([item[0] for _, item in items]):
        launches = [(key, [item]) for key, item in items]  # one by one, in order
    else:
        groups: dict[tuple, list[tuple]] = {}
        for key, item in items:
            groups.setdefault(key, []).append(item)
        launches = list(groups.items())
    bm, bn, warps = config or ((32, 32, 4) if interpret else CUDA_CONFIG)
    kernel = _kernel()
    for (_, wdtype, fdtype, (m, n), stride_w, stride_b, stride_a, n_seg, br, _), group \
            in launches:
        w, _, _, _, overflow = group[0]
        tiles = cdiv(m, bm) * cdiv(n, bn)
        with on_device_of(w):
            for i in range(0, len(group), MAX_GROUP):
                chunk = group[i:i + MAX_GROUP]
                count, slots = len(chunk), next_power_of_2(len(chunk))
                chunk += [chunk[0]] * (slots - count)  # padding slots, never selected
                ws, ups, downs, alphas, _ = zip(*chunk, strict=True)
                kernel[(tiles, count)](
                    ws, ups, downs, alphas, alphas[0] if overflow is None else overflow,
                    m, n, stride_w, stride_b, stride_a, G=slots, N_SEG=n_seg, BM=bm, BN=bn,
                    BR=br, IEEE=fdtype == torch.float32 or interpret,
                    OVERFLOW=0.0 if overflow is None else _OVERFLOW.get(wdtype, 0.0),
                    num_warps=warps, num_stages=1)


def _merge_reference(job: LowRankJob) -> None:
    """:func:`merge_lowrank_reference`, with the overflow flag set as the kernel sets it."""
    w, up, down, seg, alpha, overflow = job
    finite = None if overflow is None else torch.isfinite(w)
    merge_lowrank_reference(w, up, down, seg, alpha)
    if finite is not None:
        overflow.copy_((finite & ~torch.isfinite(w)).any().view(1) | overflow.bool())


def _overlapping(ws: list[torch.Tensor]) -> bool:
    """Whether any two of ``ws`` (2-D, unit column stride) share a byte of memory (by their
    address ranges: rows of one weight that are disjoint count as disjoint).
    """
    spans = sorted((w.data_ptr(), w.data_ptr() + ((w.shape[0] - 1) * w.stride(0) + w.shape[1])
                    * w.element_size()) for w in ws if w.numel())
    return any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1))


def padded_factors(up: torch.Tensor, down: torch.Tensor, seg: list[int], alpha: list[float]
                   ) -> tuple[torch.Tensor, torch.Tensor, list[float], int]:
    """The factors as the merge kernels index them: ``(up (M, S*br), down (S*br, N), alpha
    (S,), br)``, contributions wider than one rank step split first, each zero-padded to
    ``br`` ranks (a power of two >= 16), so rank offsets are compile-time multiples of ``br``
    (aligned vector loads, no rank masks). A single contribution already ``br`` wide is used
    as it is.
    """
    if len(alpha) == 1 and seg[1] in _RANK_STEPS:  # the common case, without the loops
        return up.contiguous(), down.contiguous(), alpha, seg[1]
    seg, alpha = _split_large_ranks(seg, alpha)
    max_r = max(seg[i + 1] - seg[i] for i in range(len(alpha)))
    br = max(16, next_power_of_2(max_r))
    if len(alpha) == 1 and max_r == br:
        return up.contiguous(), down.contiguous(), alpha, br
    up_p = up.new_zeros(up.shape[0], len(alpha) * br)
    down_p = down.new_zeros(len(alpha) * br, down.shape[1])
    for i in range(len(alpha)):
        r0, r1 = seg[i], seg[i + 1]
        up_p[:, i * br:i * br + r1 - r0] = up[:, r0:r1]
        down_p[i * br:i * br + r1 - r0] = down[r0:r1]
    return up_p, down_p, alpha, br


def _split_large_ranks(seg: list[int], alpha: list[float]) -> tuple[list[int], list[float]]:
    """Cut contributions wider than one rank step into several with the same scale."""
    out_seg, out_alpha = [seg[0]], []
    for i, a in enumerate(alpha):
        r0, r1 = seg[i], seg[i + 1]
        while r1 - r0 > _MAX_RANK_STEP:
            r0 += _MAX_RANK_STEP
            out_seg.append(r0)
            out_alpha.append(a)
        out_seg.append(r1)
        out_alpha.append(a)
    return out_seg, out_alpha
