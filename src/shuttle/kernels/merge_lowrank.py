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
from typing import NamedTuple

import torch

__all__ = ["LowRankJob", "bind_tiles", "cdiv", "device_floats", "interpreting", "merge_lowrank",
           "merge_lowrank_grouped", "merge_lowrank_reference", "next_power_of_2",
           "padded_factors", "seed32", "triton_available"]


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (it is an optional dependency: ``shuttle[triton]``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def merge_lowrank_reference(w: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                            seg: list[int], alpha: list[float]) -> None:
    """``w += sum_i alpha_i * up[:, seg_i] @ down[seg_i]`` in float32, rounded once, in place."""
    acc = w.float()
    for i, a in enumerate(alpha):
        r0, r1 = seg[i], seg[i + 1]
        acc.addmm_(up[:, r0:r1].float(), down[r0:r1].float(), alpha=a)
    w.copy_(acc)


# Shared tile helpers, bound by bind_tiles() when the kernels are built (see there).
lowrank_tile = store_rne = tile_of = None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    bind_tiles(globals(), "lowrank_tile", "store_rne", "tile_of")

    @triton.jit
    def merge_kernel(w_ptr, b_ptr, a_ptr, alpha_ptr, M, N, stride_wm, stride_bm, stride_ar,
                     N_SEG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                     IEEE: tl.constexpr):
        # b: (M, N_SEG * BR), a: (N_SEG * BR, N); contribution s owns ranks s*BR ... (s+1)*BR,
        # zero-padded, so rank offsets are compile-time multiples of BR (aligned vector loads,
        # no rank masks). One (BM, BN) tile of W per program, and many programs per SM: the
        # W load is issued first, so its latency hides behind the factor loads and the dot,
        # and other programs' loads fill the gaps. (A persistent loop over tiles measured
        # 2-3x slower: the tiles' loads were not overlapped.)
        rm, rn, mask_m, mask_n = tile_of(tl.program_id(0), M, N, BM, BN)
        mask = mask_m[:, None] & mask_n[None, :]
        ptrs = w_ptr + rm[:, None] * stride_wm + rn[None, :]
        w = tl.load(ptrs, mask=mask, other=0.0)
        acc = lowrank_tile(b_ptr, a_ptr, alpha_ptr, rm, rn, mask_m, mask_n, stride_bm, stride_ar,
                           BM, BN, N_SEG, BR, IEEE)
        store_rne(ptrs, w.to(tl.float32) + acc, mask)

    return merge_kernel


@functools.cache
def _grouped_kernel():
    import triton
    import triton.language as tl

    bind_tiles(globals(), "lowrank_tile", "store_rne", "tile_of")

    @triton.jit
    def merge_grouped_kernel(table_ptr, alpha_ptr, w_like, f_like, N_SEG: tl.constexpr,
                             LOG_JOBS: tl.constexpr, ALIGNED: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BR: tl.constexpr, IEEE: tl.constexpr):
        # table (int64): 2^LOG_JOBS first tiles, ascending (the padding past the last job
        # holds 2^62), then per job: w, b, a (addresses), M, N, stride_wm, stride_bm,
        # stride_ar. alpha: (jobs, N_SEG) float32. w_like / f_like: any tensors of the
        # weights' and the factors' dtype, for the pointer types. Each program finds its job
        # by a binary search over the first tiles, then merges one tile as merge_kernel does.
        pid = tl.program_id(0)
        job = 0
        for step in tl.static_range(LOG_JOBS):
            probe = job + (1 << (LOG_JOBS - 1 - step))
            job = tl.where(tl.load(table_ptr + probe) <= pid, probe, job)
        row = table_ptr + (1 << LOG_JOBS) + job * 8
        w_ptr = tl.load(row).to(w_like.dtype)
        b_ptr = tl.load(row + 1).to(f_like.dtype)
        a_ptr = tl.load(row + 2).to(f_like.dtype)
        m = tl.load(row + 3).to(tl.int32)
        n = tl.load(row + 4).to(tl.int32)
        stride_wm, stride_bm, stride_ar = tl.load(row + 5), tl.load(row + 6), tl.load(row + 7)
        if ALIGNED:
            # What Triton infers from arguments, stated for values read from memory: without
            # it the loads are not vectorized (measured 3x slower on the H200).
            w_ptr, b_ptr, a_ptr = (tl.multiple_of(w_ptr, 16), tl.multiple_of(b_ptr, 16),
                                   tl.multiple_of(a_ptr, 16))
            n = tl.multiple_of(n, 16)
            stride_wm, stride_bm, stride_ar = (tl.multiple_of(stride_wm, 16),
                                               tl.multiple_of(stride_bm, 16),
                                               tl.multiple_of(stride_ar, 16))
        rm, rn, mask_m, mask_n = tile_of(pid - tl.load(table_ptr + job).to(tl.int32), m, n,
                                         BM, BN)
        mask = mask_m[:, None] & mask_n[None, :]
        ptrs = w_ptr + rm[:, None] * stride_wm + rn[None, :]
        w = tl.load(ptrs, mask=mask, other=0.0)
        acc = lowrank_tile(b_ptr, a_ptr, alpha_ptr + job * N_SEG, rm, rn, mask_m, mask_n,
                           stride_bm, stride_ar, BM, BN, N_SEG, BR, IEEE)
        store_rne(ptrs, w.to(tl.float32) + acc, mask)

    return merge_grouped_kernel


# (BM, BN, num_warps) on CUDA; chosen by benchmarks/tune_merge_kernel.py on an H200 (the
# configurations within a few percent of each other run to run). A variant moving the tiles by
# TMA measured 25-35% slower in two runs (docs/benchmarks/merge_kernel_tuning.md) and was dropped.
CUDA_CONFIG: tuple[int, int, int] = (64, 128, 8)
_MAX_RANK_STEP = 128  # larger ranks are split into several contributions of at most this
_RANK_STEPS = (16, 32, 64, 128)  # ranks used as they are (seg [0, r], one contribution)


def merge_lowrank(w: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  seg: list[int], alpha: list[float],
                  config: tuple[int, int, int] | None = None) -> None:
    """In place: ``w += sum_i alpha_i * up[:, seg_i] @ down[seg_i]``, float32 sum, one rounding.

    Args:
        w: (M, N) weight, unit stride along N.
        up: (M, R) concatenated up factors, unit stride along R.
        down: (R, N) concatenated down factors, unit stride along N; same dtype as ``up``.
        seg: R-offsets of the contributions, ``[0, r_1, r_1 + r_2, ..., R]``.
        alpha: the scale of each contribution (strength x alpha / rank).
        config: ``(BM, BN, num_warps)`` to override :data:`CUDA_CONFIG`.

    Uses the Triton kernel where Triton is installed and the tensors are on CUDA (or under
    ``TRITON_INTERPRET=1``), else :func:`merge_lowrank_reference`.
    """
    assert w.dim() == up.dim() == down.dim() == 2, "merge_lowrank works on 2-D views"
    assert up.shape[1] == down.shape[0] == seg[-1] and len(seg) == len(alpha) + 1
    interpret = interpreting()
    if not triton_available() or not (w.is_cuda or interpret) or w.stride(1) != 1:
        merge_lowrank_reference(w, up, down, seg, alpha)
        return

    m, n = w.shape
    up_p, down_p, alpha, br = padded_factors(up, down, seg, alpha)
    bm, bn, warps = config or ((32, 32, 4) if interpret else CUDA_CONFIG)
    alpha_t = device_floats(alpha, w.device)
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    _kernel()[grid](
        w, up_p, down_p, alpha_t, m, n, w.stride(0), up_p.stride(0), down_p.stride(0),
        N_SEG=len(alpha), BM=bm, BN=bn, BR=br, IEEE=up.dtype == torch.float32 or interpret,
        num_warps=warps, num_stages=1)


class LowRankJob(NamedTuple):
    """One :func:`merge_lowrank` call's arguments, for :func:`merge_lowrank_grouped`."""

    w: torch.Tensor  # (M, N)
    up: torch.Tensor  # (M, R)
    down: torch.Tensor  # (R, N)
    seg: list[int]
    alpha: list[float]


def merge_lowrank_grouped(jobs: list[LowRankJob],
                          config: tuple[int, int, int] | None = None) -> None:
    """:func:`merge_lowrank` for every job, in one kernel launch per kind of job.

    A whole-model merge launches the kernel once per weight, and on the H200 the host side of
    one launch (argument handling, the scale upload) costs about as much as the kernel's 56 us
    on a 12288x3072 bf16 weight: the GPU idles between merges. Here the jobs' addresses, shapes,
    strides and scales go to the device in one table (one pinned copy) and one launch runs
    every tile of every job of one (weight dtype, factor dtype, padded rank) kind. The results
    equal :func:`merge_lowrank`'s bit for bit (the same tiles, the same arithmetic).

    Jobs must not overlap in memory (distinct weights, or distinct row ranges of one). Jobs
    the kernel cannot take (not on CUDA nor interpreted, a weight without unit stride along N)
    go through :func:`merge_lowrank` one by one.
    """
    interpret = interpreting()
    # kind -> [(table row, alpha, padded factors)]; the factors are held until the launch
    # (a padded copy freed before it could be reallocated, and overwritten, by the table).
    kinds: dict[tuple, list[tuple[tuple[int, ...], list[float], torch.Tensor, ...]]] = {}
    for job in jobs:
        w = job.w
        if (not triton_available() or not (w.is_cuda or interpret) or w.stride(1) != 1
                or len(jobs) == 1):
            merge_lowrank(w, job.up, job.down, job.seg, job.alpha, config)
            continue
        up_p, down_p, alpha, br = padded_factors(job.up, job.down, job.seg, job.alpha)
        m, n = w.shape
        row = (w.data_ptr(), up_p.data_ptr(), down_p.data_ptr(), m, n, w.stride(0),
               up_p.stride(0), down_p.stride(0))
        # What Triton's launcher checks of arguments, for values the kernel reads from the
        # table: 16-byte aligned addresses, row strides and N multiples of 16.
        aligned = not ((row[0] | row[1] | row[2] | row[4] | row[5] | row[6] | row[7]) & 15)
        key = (w.dtype, up_p.dtype, w.device, len(alpha), br, aligned)
        kinds.setdefault(key, []).append((row, alpha, w, up_p, down_p))
    bm, bn, warps = config or ((32, 32, 4) if interpret else CUDA_CONFIG)
    for (_, fdtype, device, n_seg, br, aligned), group in kinds.items():
        log_jobs = max(len(group) - 1, 0).bit_length()
        firsts, rows, alphas = [], [], []
        tiles = 0
        for row, alpha, *_ in group:
            firsts.append(tiles)
            tiles += cdiv(row[3], bm) * cdiv(row[4], bn)
            rows += row
            alphas += alpha
        firsts += [1 << 62] * ((1 << log_jobs) - len(group))
        # One int64 buffer: the table, then the scales as float32 pairs (a view on both sides).
        n_int = len(firsts) + len(rows)
        host = torch.empty(n_int + cdiv(len(alphas), 2), dtype=torch.int64,
                           pin_memory=device.type == "cuda")
        host[:n_int] = torch.tensor(firsts + rows, dtype=torch.int64)
        host[n_int:].view(torch.float32)[:len(alphas)] = torch.tensor(alphas,
                                                                      dtype=torch.float32)
        table = host.to(device, non_blocking=True)
        _grouped_kernel()[(tiles,)](
            table, table[n_int:].view(torch.float32), group[0][2], group[0][3], N_SEG=n_seg,
            LOG_JOBS=log_jobs, ALIGNED=aligned, BM=bm, BN=bn, BR=br,
            IEEE=fdtype == torch.float32 or interpret, num_warps=warps, num_stages=1)


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


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grid sizes on the host (``triton.cdiv`` is a Triton function, about
    2 us a call from Python: several per launch add up when merging hundreds of weights).
    """
    return -(-a // b)


def seed32(seed: int) -> int:
    """A 64-bit seed folded to the 32 bits of the kernels' ``hash_uniform``."""
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), on the host (as :func:`cdiv`)."""
    return 1 << max(n - 1, 0).bit_length()


def device_floats(values: list[float], device: torch.device) -> torch.Tensor:
    """A float32 tensor of ``values`` on ``device``, without a host sync; do not modify it.

    On CUDA the tensors are cached by value (the scales of one merge repeat from weight to
    weight): a new one costs a launch or a copy, several microseconds of host time per weight.
    Cached tensors are never freed (a freed one could be reused while a kernel queued on
    another stream still reads it); past :data:`_MAX_CACHED_FLOATS` values new ones are not
    cached. A new tensor goes through a pinned staging buffer, copied asynchronously:
    ``torch.tensor(values, device="cuda")`` copies from pageable memory, which waits for the
    stream to drain.
    """
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.float32, device=device)
    key = (tuple(values), device)
    cached = _FLOATS.get(key)
    if cached is not None:
        return cached
    host = torch.tensor(values, dtype=torch.float32).pin_memory()
    out = host.to(device, non_blocking=True)
    # Memory allocated while a CUDA graph is captured belongs to the graph: not cached.
    if len(_FLOATS) < _MAX_CACHED_FLOATS and not torch.cuda.is_current_stream_capturing():
        _FLOATS[key] = out
    return out


_FLOATS: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}
_MAX_CACHED_FLOATS = 4096


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


def bind_tiles(namespace: dict, *names: str) -> None:
    """Bind the helpers ``names`` of :mod:`shuttle.kernels.tiles` into ``namespace``, a kernel
    module's globals, once Triton is imported (that module imports it; Triton is optional).

    Triton resolves the functions a kernel calls among its module's globals: its interpreter
    re-executes each kernel's source with those globals only, so closure variables would not
    do.
    """
    from shuttle.kernels import tiles

    for name in names:
        namespace[name] = getattr(tiles, name)


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
