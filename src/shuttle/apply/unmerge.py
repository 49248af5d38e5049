"""Undoing a permanent merge: exactly from what the merge kept, or by subtracting the update.

``merge_lora(model, loras, keep=True)`` keeps every parameter it overwrites in its report;
:func:`unmerge_lora` with that report writes them back bit for bit, after checking that each
parameter still holds what that merge wrote (:mod:`shuttle.apply.kept`: the same object, no
later kept merge still in force, nothing written since). Without a kept copy the update is
subtracted: ``merge_lora`` with every strength negated, one more rounding. The result is then
within two roundings of the original weight (the merge's and this one's), and the report gives
that bound per parameter, in the weight's own units.

On DTensor parameters each rank writes back (or subtracts from) its own shard; every rank
checks before any rank writes (:func:`~shuttle.apply.sharded.agreed`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from shuttle.apply.kept import check_undo, release
from shuttle.apply.merge import MergeReport, merge_lora
from shuttle.apply.open_scopes import merged_parameters
from shuttle.apply.param_merge import restore_param
from shuttle.apply.pipeline import Pipeline, as_model
from shuttle.apply.plan import AdapterList, normalize_adapters
from shuttle.apply.rounding import Rounding, rounding_for
from shuttle.apply.sharded import agreed
from shuttle.errors import InvalidOptionError, ShapeMismatchError, ShuttleError
from shuttle.formats import LoRA
from shuttle.targets import KeyMapping
from shuttle.weights import WeightRepresentation, represent
from shuttle.weights.dtensor import ShardWindow, sharded
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
            weights four times the largest error of encoding their values to nearest). For a
            DTensor parameter, of this rank's shard. Empty when ``exact``.
        merge: the report of the subtracting merge (None when ``exact``).
        discarded: with ``force=True``, per parameter, the change since the merge that writing
            its kept copy back discarded (a later kept merge, an in-place edit). Empty
            otherwise.
    """

    restored: list[str]
    exact: bool
    error_bound: dict[str, float] = dataclasses.field(default_factory=dict)
    merge: MergeReport | None = None
    discarded: dict[str, str] = dataclasses.field(default_factory=dict)


def unmerge_lora(
    model: torch.nn.Module | Pipeline,
    merged: MergeReport | AdapterList,
    *,
    mapping: KeyMapping | None = None,
    rounding: Rounding | None = None,
    seed: int | None = None,
    strict: bool = False,
    force: bool = False,
) -> UnmergeReport:
    """Undo a :func:`~shuttle.merge_lora` on ``model``.

    Args:
        model: the model (or pipeline) the merge changed.
        merged: the merge's report, when it was made with ``keep=``: its kept parameters are
            written back exactly (a report built by hand, without the merge's stamp, is
            checked for shapes only). Or the adapters and strengths that were merged: their
            update is subtracted (``merge_lora`` at the negated strengths), within the
            :attr:`UnmergeReport.error_bound` of the original; in any order.
        mapping, rounding, seed, strict: for a subtraction, as for ``merge_lora``.
        force: write the kept copies back even where a later kept merge is still in force or
            a parameter was written or replaced since the merge, discarding that change
            (listed in :attr:`UnmergeReport.discarded`; a later kept merge discarded so can
            no longer be undone from its report). Shapes, dtypes and open ``apply_lora``
            blocks are checked all the same.

    Raises:
        InvalidOptionError: ``merged`` is neither a merge report nor a list of
            ``(lora, strength)`` pairs (None, say).
        ShuttleError: a report that kept nothing (merge with ``keep=True``, or pass the
            adapters to subtract them); adapters to subtract with a patch whose update
            depends on the weight (DoRA, (IA)3, OFT, replacements), which a subtraction
            cannot undo.
        ShapeMismatchError: a kept parameter no longer exists, or changed shape, dtype, form
            or (DTensor) shard since the merge.
        ScopeOrderError: a later kept merge of a kept parameter is still in force (undo it
            first; or ``force``), an open ``apply_lora(mode="merge")`` block holds one, or the
            merge was undone already.
        ParameterChangedError: a kept parameter was replaced by another object or written
            since the merge (an in-place edit, a merge without ``keep=``); ``force`` writes
            anyway.
        RankFailedError: on a sharded model, another rank's check failed.
        Everything :func:`~shuttle.merge_lora` raises, for a subtraction.
        Nothing is written when any of these is raised.
    """
    model = as_model(model)
    if isinstance(merged, MergeReport):
        if merged.kept is None:
            raise ShuttleError(
                "this merge kept nothing to write back: merge with merge_lora(..., keep=True), "
                "or pass the adapters and strengths that were merged to subtract them")
        return _write_back(model, merged, force)
    if not (isinstance(merged, LoRA) or isinstance(merged, Sequence)
            and not isinstance(merged, (str, bytes))):
        raise InvalidOptionError(
            f"unmerge_lora(model, {type(merged).__name__}): pass the MergeReport of "
            "merge_lora(..., keep=True) to write its copies back exactly, or the "
            "[(lora, strength), ...] that were merged to subtract them")
    pairs, per_component = normalize_adapters(merged)
    weighty = sorted({p.kind for lora, _ in pairs for _, p in lora.patches() if not p.additive})
    if weighty:
        raise ShuttleError(
            f"the adapters hold {', '.join(weighty)} patches, whose update depends on the "
            "weight it changes (a rotation, a scale, a replacement): merging them at the "
            "negated strength does not undo them. Merge with merge_lora(..., keep=True) and "
            "pass its report here to write the weights back exactly; nothing was written.")
    negated = [(lora, {c: -s for c, s in per_component[i].items()} if i in per_component
                else -strength) for i, (lora, strength) in enumerate(pairs)]
    params = dict(model.named_parameters())
    merged_top = {name: _top(p) for name, p in params.items()}  # before the subtraction
    report = merge_lora(model, negated, mapping=mapping, rounding=rounding, seed=seed,
                        strict=strict)
    bounds = {name: _bound(params[name], merged_top[name], rounding)
              for name in report.applied}
    return UnmergeReport(list(report.applied), False, bounds, report)


def _write_back(model: torch.nn.Module, merged: MergeReport, force: bool) -> UnmergeReport:
    kept = merged.kept
    assert kept is not None
    params = dict(model.named_parameters())
    stamp = merged._stamp

    def validate() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        targets = {name: _target(params, name, saved,
                                 None if stamp is None else stamp.windows.get(name))
                   for name, saved in kept.items()}
        discarded = {} if stamp is None else check_undo(
            stamp, params, set(merged_parameters(model)), force)
        return targets, discarded

    # every check, on every rank of a sharded model, before the first write
    targets, discarded = agreed(params, validate)
    for name, saved in kept.items():
        restore_param(targets[name], saved)
    if stamp is not None:
        release(stamp, params)
    return UnmergeReport(list(kept), True, discarded=discarded)


def _target(params: Mapping[str, torch.Tensor], name: str,
            saved: torch.Tensor | WeightRepresentation, window: ShardWindow | None
            ) -> torch.Tensor:
    """The tensor ``saved`` is written into: the parameter, or a DTensor's local shard.

    Raises:
        ShapeMismatchError: no such parameter, or it changed shape, dtype, form or shard.
    """
    p = params.get(name)
    if p is None:
        raise ShapeMismatchError(f"{name!r} was merged but the model has no such parameter "
                                 "now; nothing was written back")
    shard = sharded(p, name)
    if shard is not None:
        if window is not None and shard.window != window:
            raise ShapeMismatchError(
                f"{name!r} was resharded since the merge (this rank held {window}, now "
                f"{shard.window}); the kept copy is the old shard. Nothing was written back")
        p = shard.local
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
    return p


def _local(p: torch.Tensor) -> torch.Tensor:
    """``p``, or this rank's shard of a DTensor."""
    shard = sharded(p)
    return p if shard is None else shard.local


def _top(p: torch.Tensor) -> float:
    """The largest magnitude ``p`` holds (of its values, for an encoding; of this rank's shard,
    for a DTensor).
    """
    p = _local(p)
    w = p.detach() if is_plain_tensor(p) else represent(p).dequantize()
    return float(w.abs().max().float()) if w.numel() else 0.0


def _bound(p: torch.Tensor, merged_top: float, rounding: Rounding | None) -> float:
    """Two roundings at the largest magnitude ``p`` held (merged) or holds, in its units; a
    float32 or float64 weight sums in its own precision, so the update's product adds up to
    as much again.
    """
    p = _local(p)
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
