"""The fused low-rank merge's jobs: plain low-rank contributions concatenated along the rank
per row range (:class:`LowRankSum`), handed to the Triton kernel that reads W once, adds every
update in its float32 accumulator and writes W once (one rounding), and the overflow flag that
kernel sets only where the update could carry a finite weight past its dtype's range.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from shuttle.apply.memo import MergeMemo
from shuttle.apply.plan import Contribution
from shuttle.kernels import triton_available
from shuttle.kernels.merge_lowrank import LowRankJob, merge_lowrank_many, overflow_margin
from shuttle.patches import LowRank
from shuttle.weights.plain import is_plain_tensor

__all__ = ["FUSED_DTYPES", "LowRankSum", "cannot_overflow", "fused_jobs", "kernel_takes",
           "lowrank_sums", "merge_fused", "on_kernel_device", "overflow_flag", "plain_lowrank",
           "update_bound"]


class LowRankSum(NamedTuple):
    """Plain low-rank contributions to one row range, concatenated along the rank:
    the update is ``sum_i scales[i] * up[:, seg[i]:seg[i+1]] @ down[seg[i]:seg[i+1]]``.
    """

    up: torch.Tensor  # (rows, R)
    down: torch.Tensor  # (R, N)
    seg: list[int]
    scales: list[float]  # per contribution: strength x alpha / rank


def lowrank_sums(contribs: list[Contribution]
                 ) -> dict[tuple[int, int] | None, LowRankSum] | None:
    """Per row range (None: the whole weight), the contributions as one :class:`LowRankSum`;
    None where a fused kernel cannot take them (another patch kind, Tucker or transposed
    factors, mixed factor dtypes, or a whole-weight and a row-range update together).
    """
    if len(contribs) == 1:  # the common case: no grouping by rows, no concatenation
        c = contribs[0]
        patch = c.patch
        if not plain_lowrank(patch):
            return None
        up, down = patch.factors()
        if up.dtype != down.dtype or up.dtype == torch.float64:  # the kernels sum in float32
            return None
        return {c.rows: LowRankSum(up, down, [0, down.shape[0]],
                                   [c.strength * patch.effective_scale])}
    groups: dict[tuple[int, int] | None, list[Contribution]] = {}
    factor_dtypes = set()
    for c in contribs:
        patch = c.patch
        if not plain_lowrank(patch):
            return None
        factor_dtypes |= {patch.up.dtype, patch.down.dtype}
        groups.setdefault(c.rows, []).append(c)
    if len(factor_dtypes) != 1 or torch.float64 in factor_dtypes \
            or (None in groups and len(groups) > 1):
        return None
    sums = {}
    for rows, cs in groups.items():
        ups, downs = zip(*(c.patch.factors() for c in cs), strict=True)
        seg = [0]
        for d in downs:
            seg.append(seg[-1] + d.shape[0])
        one = len(cs) == 1  # no concatenation (a copy) for the usual single adapter
        sums[rows] = LowRankSum(ups[0] if one else torch.cat(ups, dim=1),
                                downs[0] if one else torch.cat(downs, dim=0), seg,
                                [c.strength * c.patch.effective_scale for c in cs])
    return sums


def merge_fused(p: torch.Tensor, contribs: list[Contribution],
                 overflow: torch.Tensor | None = None) -> bool:
    """The single-pass CUDA path; returns False (doing nothing) where it does not apply."""
    jobs = fused_jobs(p, contribs, overflow)
    if jobs is None:
        return False
    merge_lowrank_many(jobs)
    return True


def fused_jobs(p: torch.Tensor, contribs: list[Contribution],
                overflow: torch.Tensor | None = None) -> list[LowRankJob] | None:
    """The fused kernel's jobs for ``p``, or None where that kernel does not apply.

    Plain low-rank contributions are concatenated along the rank per row range, for the fused
    Triton kernel: W read once, written once, one rounding. Not for float64 weights (the
    kernel accumulates in float32), quantized weights, nor weights off the kernel device.
    """
    if not kernel_takes(p):
        return None
    sums = lowrank_sums(contribs)
    if sums is None:
        return None
    # the parameter itself when 2-D (no new tensor object: host time per weight counts here)
    w2d = p if p.dim() == 2 else p.detach().view(p.shape[0], -1)
    return [LowRankJob(w2d if rows is None else w2d[rows[0]:rows[1]], *lr, overflow)
            for rows, lr in sums.items()]


def overflow_flag(p: torch.Tensor, contribs: list[Contribution],
                  flags: dict[torch.device, torch.Tensor], memo: MergeMemo | None = None
                  ) -> torch.Tensor | None:
    """The flag for :func:`merge_param`'s ``overflow``: ``p``'s device's one in ``flags``
    (created at its first use), or None where the fused kernel does not take ``p`` or its
    patches (the other paths raise on overflow themselves) or the update cannot overflow the
    weight (the kernel then skips the check, a fifth of its time, and the caller a sync).
    ``memo``: where the finite check left the adapter tensors' maxima (None: not measured).
    """
    if not (kernel_takes(p) and all(plain_lowrank(c.patch) for c in contribs)) \
            or cannot_overflow(p.dtype, contribs, memo):
        return None
    flag = flags.get(p.device)
    if flag is None:
        flag = flags[p.device] = torch.zeros(1, dtype=torch.int32, device=p.device)
    return flag


def cannot_overflow(dtype: torch.dtype, contribs: list[Contribution],
                     memo: MergeMemo | None) -> bool:
    """Whether the update is too small to carry any finite weight of ``dtype`` past its
    overflow threshold: ``|update| <= sum_i |m_i s_i| r_i max|up_i| max|down_i|`` (each
    element of ``up @ down`` sums r products), from the maxima the finite check measured,
    against :func:`overflow_margin` with a factor 2 to spare for float32 rounding. False
    where it cannot tell (a patch other than a plain low-rank product, an unmeasured tensor).
    """
    margin = overflow_margin(dtype)
    if margin is None:
        return True
    return update_bound(contribs, memo) * 2 < margin


def update_bound(contribs: list[Contribution], memo: MergeMemo | None) -> float:
    """``sum_i |m_i s_i| r_i max|up_i| max|down_i|``, a bound on every element of the update;
    infinity where it cannot tell (another patch kind, an unmeasured tensor).
    """
    if memo is None:
        return math.inf
    bound = 0.0
    for c in contribs:
        if not plain_lowrank(c.patch):
            return math.inf
        up, down = memo.known_abs_max(c.patch.up), memo.known_abs_max(c.patch.down)
        if up is None or down is None:
            return math.inf
        bound += abs(c.strength * c.patch.effective_scale) * c.patch.rank * up * down
    return bound


# The fused kernel accumulates in float32: float64 weights take the float64 path.
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernel_takes(p: torch.Tensor) -> bool:
    """Whether the fused kernel can merge into parameter ``p`` (its patches aside)."""
    return (p.dtype in FUSED_DTYPES and is_plain_tensor(p) and on_kernel_device(p)
            and p.dim() >= 2 and p.is_contiguous() and triton_available())


def plain_lowrank(patch: object) -> bool:
    """A low-rank product the fused kernel takes: no Tucker core, factors not transposed."""
    return isinstance(patch, LowRank) and patch.mid is None and not patch.transposed


def on_kernel_device(p: torch.Tensor) -> bool:
    """Whether ``p`` lives where the merge kernels run (CUDA; tests add the interpreter)."""
    return p.is_cuda
