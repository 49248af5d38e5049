"""Fused low-rank merge: ``W <- round(W + sum_i scale_i * B_i @ A_i)`` with one rounding.

W is (M, N) in bf16/fp16/fp32; the factors of all contributions are concatenated along the rank:
B (M, R) and A (R, N), with contribution i owning ranks ``seg[i]:seg[i+1]`` and scale
``scales[i]`` (its strength x alpha / rank: the whole factor the update is multiplied by, not the
file's ``alpha``). Each program loads one (BM, BN) tile of W once, accumulates every contribution's
product in float32 (the products of bf16/fp16 factors are exact in float32), adds, rounds once
and stores: W is read once and written once, which makes the merge memory-bound at about the
device's copy bandwidth. cuBLAS's in-place ``addmm_`` on bf16 does not give this: it rounds the
scaled product to bf16 before adding it to W (measured, docs/benchmarks/merge.md).

A whole-model merge goes through :class:`LowRankMerges`: one launch merges up to
:data:`MAX_GROUP` weights of the same shape (the kernel takes tuples of their pointers), so the
host issues a launch per group rather than per weight; its recorded launches can be replayed
(:func:`replay_merges`, used by ``shuttle.apply.recipe``).

:func:`merge_lowrank_reference` is the same computation in PyTorch, used as the fallback and as
the oracle the kernel is tested against (on CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from shuttle.kernels.launch import (
    cdiv,
    device_floats,
    interpreting,
    next_power_of_2,
    on_device_of,
    triton_available,
)

__all__ = ["RANK_STEPS", "LowRankJob", "LowRankMerges", "MergeLaunch", "merge_lowrank",
           "merge_lowrank_many", "merge_lowrank_reference", "overflow_margin", "padded_factors",
           "replay_merges"]


def merge_lowrank_reference(w: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                            seg: list[int], scales: list[float]) -> None:
    """``w += sum_i scale_i * up[:, seg_i] @ down[seg_i]`` in float32, rounded once, in place."""
    acc = w.float()
    for i, a in enumerate(scales):
        r0, r1 = seg[i], seg[i + 1]
        acc.addmm_(up[:, r0:r1].float(), down[r0:r1].float(), alpha=a)
    w.copy_(acc)


# Shared tile helpers, bound by tiles.bind_tiles() when the kernels are built (see there).
lowrank_tile = pick = store_rne = tile_of = None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    from shuttle.kernels.tiles import bind_tiles

    bind_tiles(globals(), "lowrank_tile", "pick", "store_rne", "tile_of")

    @triton.jit
    def merge_kernel(ws, bs, as_, scale_ts, flag_ptr, M, N, stride_wm, stride_bm, stride_ar,
                     G: tl.constexpr, N_SEG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BR: tl.constexpr, IEEE: tl.constexpr, OVERFLOW: tl.constexpr):
        # Job j = program_id(1) of G (tuples of G pointers: weights w (M, N), factors b
        # (M, N_SEG * BR) and a (N_SEG * BR, N), scales (N_SEG,)); every job of one launch
        # has the same shapes and strides. Contribution s owns ranks s*BR ... (s+1)*BR,
        # zero-padded, so rank offsets are compile-time multiples of BR (aligned vector loads,
        # no rank masks). One (BM, BN) tile of W per program, and many programs per SM: the
        # W load is issued first, so its latency hides behind the factor loads and the dot,
        # and other programs' loads fill the gaps. (A persistent loop over tiles is slower:
        # its tiles' loads are not overlapped.)
        j = tl.program_id(1)
        w_ptr, b_ptr = pick(ws, j, G), pick(bs, j, G)
        a_ptr, scales_ptr = pick(as_, j, G), pick(scale_ts, j, G)
        rm, rn, mask_m, mask_n = tile_of(tl.program_id(0), M, N, BM, BN)
        mask = mask_m[:, None] & mask_n[None, :]
        ptrs = w_ptr + rm[:, None] * stride_wm + rn[None, :]
        w = tl.load(ptrs, mask=mask, other=0.0)
        acc = lowrank_tile(b_ptr, a_ptr, scales_ptr, rm, rn, mask_m, mask_n, stride_bm, stride_ar,
                           BM, BN, N_SEG, BR, IEEE)
        x = w.to(tl.float32) + acc
        store_rne(ptrs, x, mask)
        if OVERFLOW > 0:
            # a finite sum that rounds to infinity (float16: |x| >= 65520): flag it, by one
            # store per tile after a tile-wide max (a masked store per element is slower:
            # docs/benchmarks/merge_kernel_tuning_wide.md)
            bad = mask & (tl.abs(x) >= OVERFLOW) & (tl.abs(x) < float("inf"))
            if tl.max(bad.to(tl.int32)) > 0:
                tl.store(flag_ptr, 1)

    return merge_kernel


# (BM, BN, num_warps) on CUDA; chosen by benchmarks/tune_merge_kernel.py
# (docs/benchmarks/merge_kernel_tuning_wide.md; the leading configurations lie within a few
# percent of each other). A variant moving the tiles by TMA is slower
# (docs/benchmarks/merge_kernel_tuning.md) and was dropped.
CUDA_CONFIG: tuple[int, int, int] = (64, 128, 8)
# The most weights one launch merges (benchmarks/merge.py --max-group): a whole-model merge
# launches once per group of same-shaped weights, not once per weight, so that the host's
# Python and launch time per weight stays below the GPU's.
MAX_GROUP = 8
_MAX_RANK_STEP = 128  # larger ranks are split into several contributions of at most this
# Ranks the kernel takes as they are (seg [0, r], one contribution); others are zero-padded.
RANK_STEPS = (16, 32, 64, 128)
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
    ``w += sum_i scales[i] * up[:, seg[i]:seg[i+1]] @ down[seg[i]:seg[i+1]]``.
    """

    w: torch.Tensor  # (M, N), unit stride along N
    up: torch.Tensor  # (M, R), unit stride along R
    down: torch.Tensor  # (R, N), unit stride along N; the dtype of up
    seg: list[int]  # R-offsets of the contributions, [0, r_1, r_1 + r_2, ..., R]
    scales: list[float]  # the scale of each contribution (strength x alpha / rank)
    overflow: torch.Tensor | None = None  # see merge_lowrank


def merge_lowrank(w: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  seg: list[int], scales: list[float],
                  config: tuple[int, int, int] | None = None,
                  overflow: torch.Tensor | None = None) -> None:
    """In place: ``w += sum_i scale_i * up[:, seg_i] @ down[seg_i]``, float32 sum, one rounding.

    Args:
        w: (M, N) weight, unit stride along N.
        up: (M, R) concatenated up factors, unit stride along R.
        down: (R, N) concatenated down factors, unit stride along N; same dtype as ``up``.
        seg: R-offsets of the contributions, ``[0, r_1, r_1 + r_2, ..., R]``.
        scales: the scale of each contribution (strength x alpha / rank).
        config: ``(BM, BN, num_warps)`` to override :data:`CUDA_CONFIG`.
        overflow: a one-element int32 tensor on ``w``'s device, set to 1 where a finite
            sum rounds to infinity (float16: |x| >= 65520; bfloat16 near 3.4e38); for the
            caller to read when it syncs anyway (no host sync here).

    Uses the Triton kernel where Triton is installed and the tensors are on CUDA (or under
    ``TRITON_INTERPRET=1``), else :func:`merge_lowrank_reference`.
    """
    merge_lowrank_many([LowRankJob(w, up, down, seg, scales, overflow)], config)


def merge_lowrank_many(jobs: Sequence[LowRankJob],
                       config: tuple[int, int, int] | None = None) -> None:
    """:func:`merge_lowrank` for every job, in grouped launches (see :class:`LowRankMerges`).

    The results equal one :func:`merge_lowrank` per job bit for bit: the same tiles, the same
    arithmetic.
    """
    merges = LowRankMerges(config)
    for job in jobs:
        merges.add(job)
    merges.flush()


class LowRankMerges:
    """Fused merges launched in groups as they are added: one launch runs up to
    :data:`MAX_GROUP` jobs of the same shapes, strides and dtypes (a model's layers repeat a few
    shapes), so the host spends one launch, not one per weight.

    Each kind's groups grow 1, 2, 4, ... up to MAX_GROUP: the first job is launched at once and
    the GPU merges while the host prepares the next ones (collecting every job before the
    first launch left the GPU idle for the whole host loop, which was slower end to end than
    one launch per weight). Jobs whose weights overlap in memory (row ranges of one
    weight that overlap) never share a launch and run in the order added. Call :meth:`flush`
    at the end: it launches what is left.

    With ``record=True`` every launch is also kept in :attr:`launches`, for
    :func:`replay_merges` to repeat the same merges without redoing the host work; None once
    a job took the PyTorch fallback instead, or after :meth:`stop_recording`.
    """

    def __init__(self, config: tuple[int, int, int] | None = None, *, record: bool = False):
        self._interpret = interpreting()
        bm, bn, warps = config or ((32, 32, 4) if self._interpret else CUDA_CONFIG)
        self._tile = (bm, bn, warps)
        self._pending: dict[tuple, list[tuple]] = {}  # kind -> jobs not launched yet
        self._launches: dict[tuple, int] = {}  # kind -> launches so far
        self._spans: list[tuple[int, int]] = []  # address ranges added since the last flush
        self.launches: list[MergeLaunch] | None = [] if record else None

    def add(self, job: LowRankJob) -> None:
        """Queue ``job``; launches its kind's group when full."""
        w, up, down, seg, scales, overflow = job
        assert w.dim() == up.dim() == down.dim() == 2, "merge_lowrank works on 2-D views"
        assert up.shape[1] == down.shape[0] == seg[-1] and len(seg) == len(scales) + 1
        if not triton_available() or not (w.is_cuda or self._interpret) or w.stride(1) != 1:
            self.flush()  # in order with the jobs before it
            _merge_reference(job)
            self.stop_recording()  # not a launch: cannot be replayed
            return
        if not w.numel():
            return
        if self._overlaps(w):  # (which records w's range where it returns False)
            self.flush()
            self._overlaps(w)
        up_p, down_p, scales, br = padded_factors(up, down, seg, scales)
        # what the kernel is specialized on or takes as scalar arguments
        kind = (w.dtype, up_p.dtype, w.shape, w.stride(0), up_p.stride(0), down_p.stride(0),
                len(scales), br, None if overflow is None else id(overflow), w.device)
        group = self._pending.setdefault(kind, [])
        group.append((w, up_p, down_p, device_floats(scales, w.device), overflow))
        if len(group) >= min(MAX_GROUP, 1 << self._launches.get(kind, 0)):
            self._launch(kind)

    def stop_recording(self) -> None:
        """Drop the recorded launches and record no more (the merge cannot be replayed)."""
        self.launches = None

    def flush(self) -> None:
        """Launch every queued job."""
        for kind in list(self._pending):
            self._launch(kind)
        self._spans.clear()

    def _overlaps(self, w: torch.Tensor) -> bool:
        """Whether ``w`` shares memory with a weight added since the last flush (by address
        ranges: disjoint rows of one weight are disjoint); else records its range.
        """
        start = w.data_ptr()
        span = (start, start + ((w.shape[0] - 1) * w.stride(0) + w.shape[1]) * w.element_size())
        i = bisect.bisect(self._spans, span)
        if (i and self._spans[i - 1][1] > start) or (i < len(self._spans)
                                                   and self._spans[i][0] < span[1]):
            return True
        self._spans.insert(i, span)
        return False

    def _launch(self, kind: tuple) -> None:
        group = self._pending.pop(kind, None)
        if not group:
            return
        self._launches[kind] = self._launches.get(kind, 0) + 1
        wdtype, fdtype, (m, n), stride_w, stride_b, stride_a, n_seg, br, _, _ = kind
        bm, bn, warps = self._tile
        overflow = group[0][4]
        count, slots = len(group), next_power_of_2(len(group))
        # padding slots repeat the first job and are never selected (the grid has count jobs)
        ws, ups, downs, scale_ts, _ = zip(*group, *[group[0]] * (slots - count), strict=True)
        launch = MergeLaunch(
            (cdiv(m, bm) * cdiv(n, bn), count),
            (ws, ups, downs, scale_ts, scale_ts[0] if overflow is None else overflow, m, n,
             stride_w, stride_b, stride_a),
            {"G": slots, "N_SEG": n_seg, "BM": bm, "BN": bn, "BR": br,
             "IEEE": fdtype == torch.float32 or self._interpret,
             "OVERFLOW": 0.0 if overflow is None else _OVERFLOW.get(wdtype, 0.0),
             "num_warps": warps, "num_stages": 1})
        if self.launches is not None:
            self.launches.append(launch)
        _run(launch)


class MergeLaunch(NamedTuple):
    """One launch of the fused merge kernel: its grid and arguments."""

    grid: tuple[int, int]
    args: tuple
    kwargs: dict


def replay_merges(launches: Sequence[MergeLaunch]) -> None:
    """Launch recorded merges again (see :class:`LowRankMerges`): the same weights, factors
    and scales are merged again; the caller checks that they are still the right tensors.
    """
    for launch in launches:
        _run(launch)


def _run(launch: MergeLaunch) -> None:
    with on_device_of(launch.args[0][0]):
        _kernel()[launch.grid](*launch.args, **launch.kwargs)


def _merge_reference(job: LowRankJob) -> None:
    """:func:`merge_lowrank_reference`, with the overflow flag set as the kernel sets it."""
    w, up, down, seg, scales, overflow = job
    finite = None if overflow is None else torch.isfinite(w)
    merge_lowrank_reference(w, up, down, seg, scales)
    if finite is not None:
        overflow.copy_((finite & ~torch.isfinite(w)).any().view(1) | overflow.bool())


def padded_factors(up: torch.Tensor, down: torch.Tensor, seg: list[int], scales: list[float]
                   ) -> tuple[torch.Tensor, torch.Tensor, list[float], int]:
    """The factors as the merge kernels index them: ``(up (M, S*br), down (S*br, N), scales
    (S,), br)``, contributions wider than one rank step split first, each zero-padded to
    ``br`` ranks (a power of two >= 16), so rank offsets are compile-time multiples of ``br``
    (aligned vector loads, no rank masks). A single contribution already ``br`` wide is used
    as it is.
    """
    if len(scales) == 1 and seg[1] in RANK_STEPS:  # the common case, without the loops
        return up.contiguous(), down.contiguous(), scales, seg[1]
    seg, scales = _split_large_ranks(seg, scales)
    max_r = max(seg[i + 1] - seg[i] for i in range(len(scales)))
    br = max(16, next_power_of_2(max_r))
    if len(scales) == 1 and max_r == br:
        return up.contiguous(), down.contiguous(), scales, br
    up_p = up.new_zeros(up.shape[0], len(scales) * br)
    down_p = down.new_zeros(len(scales) * br, down.shape[1])
    for i in range(len(scales)):
        r0, r1 = seg[i], seg[i + 1]
        up_p[:, i * br:i * br + r1 - r0] = up[:, r0:r1]
        down_p[i * br:i * br + r1 - r0] = down[r0:r1]
    return up_p, down_p, scales, br


def _split_large_ranks(seg: list[int], scales: list[float]) -> tuple[list[int], list[float]]:
    """Cut contributions wider than one rank step into several with the same scale."""
    out_seg, out_scales = [seg[0]], []
    for i, a in enumerate(scales):
        r0, r1 = seg[i], seg[i + 1]
        while r1 - r0 > _MAX_RANK_STEP:
            r0 += _MAX_RANK_STEP
            out_seg.append(r0)
            out_scales.append(a)
        out_seg.append(r1)
        out_scales.append(a)
    return out_seg, out_scales
