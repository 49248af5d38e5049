"""Undoing a permanent merge: exactly from what the merge kept, or by subtracting the update.

``merge_lora(model, loras, keep=True)`` keeps every parameter it overwrites in its report;
:func:`unmerge_lora` with that report writes them back bit for bit. Without a kept copy the
update is subtracted: ``merge_lora`` with every strength negated, one more rounding. The result
is then within two roundings of the original weight (the merge's and this one's), and the
report gives that bound per parameter, in the weight's own units.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from shuttle.apply.merge import MergeReport, merge_lora, restore_param
from shuttle.apply.pipeline import Pipeline, as_model
from shuttle.apply.plan import AdapterList, normalize_adapters
from shuttle.apply.rounding import Rounding, rounding_for
from shuttle.errors import ShapeMismatchError, ShuttleError
from shuttle.targets import KeyMapping
from shuttle.weights import WeightRepresentation, represent
from shuttle.weights.plain import is_plain_tensor

__all__ = ["UnmergeReport", "unmerge_lora"]


@dataclasses.dataclass
class UnmergeReport:
    """What :func:`unmerge_lora` did.

    Attributes:
        restored: the parameters written back (or subtracted from).
        exact: True when they were written back from a kept copy, bit for bit.
        error_bound: per parameter, how far from the original weight any element may be
            after a subtraction: two roundings at the largest magnitude the weight held merged
            or holds now (nearest: one ulp there, stochastic: two; twice that for float32 and
            float64 weights, whose update is summed in their own precision; for quantized
            weights four times the largest error of encoding their values to nearest). Empty
            when ``exact``.
        merge: the report of the subtracting merge (None when ``exact``).
    """

    restored: list[str]
    exact: bool
    error_bound: dict[str, float] = dataclasses.field(default_factory=dict)
    merge: MergeReport | None = None


def unmerge_lora(
    model: torch.nn.Module | Pipeline,
    merged: MergeReport | AdapterList,
    *,
    mapping: KeyMapping | None = None,
    rounding: Rounding | None = None,
    seed: int | None = None,
    strict: bool = False,
) -> UnmergeReport:
    """Undo a :func:`~shuttle.merge_lora` on ``model``.

    Args:
        model: the model (or pipeline) the merge changed.
        merged: the merge's report, when it was made with ``keep=``: its kept parameters are
            written back exactly. Or the adapters and strengths that were merged: their update
            is subtracted (``merge_lora`` at the negated strengths), within the
            :attr:`UnmergeReport.error_bound` of the original.
        mapping, rounding, seed, strict: for a subtraction, as for ``merge_lora``.

    Raises:
        ShuttleError: a report that kept nothing (merge with ``keep=True``, or pass the
            adapters to subtract them).
        ShapeMismatchError: a kept parameter no longer exists, or changed shape, dtype or
            form since the merge; nothing is written.
        Everything :func:`~shuttle.merge_lora` raises, for a subtraction.
    """
    model = as_model(model)
    if isinstance(merged, MergeReport):
        if merged.kept is None:
            raise ShuttleError(
                "this merge kept nothing to write back: merge with merge_lora(..., keep=True), "
                "or pass the adapters and strengths that were merged to subtract them")
        return _write_back(model, merged.kept)
    pairs, per_component = normalize_adapters(merged)
    negated = [(lora, {c: -s for c, s in per_component[i].items()} if i in per_component
                else -strength) for i, (lora, strength) in enumerate(pairs)]
    params = dict(model.named_parameters())
    merged_top = {name: _top(p) for name, p in params.items()}  # before the subtraction
    report = merge_lora(model, negated, mapping=mapping, rounding=rounding, seed=seed,
                        strict=strict)
    bounds = {name: _bound(params[name], merged_top[name], rounding)
              for name in report.applied}
    return UnmergeReport(list(report.applied), False, bounds, report)


def _write_back(model: torch.nn.Module,
                kept: dict[str, torch.Tensor | WeightRepresentation]) -> UnmergeReport:
    params = dict(model.named_parameters())
    for name, saved in kept.items():  # every check before the first write
        p = params.get(name)
        if p is None:
            raise ShapeMismatchError(f"{name!r} was merged but the model has no such parameter "
                                     "now; nothing was written back")
        if isinstance(saved, WeightRepresentation):
            now = None if is_plain_tensor(p) else represent(p)
            same = now is not None and type(now) is type(saved) and all(
                t.shape == now.tensors()[n].shape and t.dtype == now.tensors()[n].dtype
                for n, t in saved.tensors().items())
        else:
            same = is_plain_tensor(p) and p.shape == saved.shape and p.dtype == saved.dtype
        if not same:
            raise ShapeMismatchError(f"{name!r} changed its shape, dtype or form since the "
                                     "merge; nothing was written back")
    for name, saved in kept.items():
        restore_param(params[name], saved)
    return UnmergeReport(list(kept), True)


def _top(p: torch.Tensor) -> float:
    """The largest magnitude ``p`` holds (of its values, for an encoding)."""
    w = p.detach() if is_plain_tensor(p) else represent(p).dequantize()
    return float(w.abs().max().float()) if w.numel() else 0.0


def _bound(p: torch.Tensor, merged_top: float, rounding: Rounding | None) -> float:
    """Two roundings at the largest magnitude ``p`` held (merged) or holds, in its units; a
    float32 or float64 weight sums in its own precision, so the update's product adds up to
    as much again.
    """
    if not (is_plain_tensor(p) and p.is_floating_point()):
        # An encoding (NF4, int8, ...): its steps depend on its blocks' scales; the largest
        # error of encoding the current values to nearest is half a step, and two stochastic
        # roundings move an element by less than two steps: four of those halves.
        rep = represent(p)
        w = rep.dequantize()
        return 4 * float((rep.encode(w, "nearest").dequantize() - w).abs().max())
    steps = 1 if rounding_for(rounding, p.dtype) == "nearest" else 2
    if p.dtype in (torch.float32, torch.float64):
        steps *= 2
    return steps * _step(max(merged_top, _top(p)), p.dtype)


def _step(top: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype`` at magnitude ``top`` (one ulp)."""
    finfo = torch.finfo(dtype)
    return 2.0 ** math.floor(math.log2(max(top, finfo.tiny))) * finfo.eps
