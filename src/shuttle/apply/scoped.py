"""Scoped application: ``with apply_lora(model, loras): ...`` restores every weight bit for bit."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch

from shuttle.apply.auto import DEFAULT_THRESHOLD, AutoReport, check_threshold, decide
from shuttle.apply.checks import check_landed, check_mergeable
from shuttle.apply.dynamic import (
    QUALITIES,
    DynamicAdapters,
    attach_lora,
    attach_plan,
    default_quality,
    tied_parameters,
)
from shuttle.apply.dynamic_layer import Quality
from shuttle.apply.merge import MergeReport, merge_plan
from shuttle.apply.notes import plan_notes
from shuttle.apply.open_scopes import OPEN_SCOPES, MergeScope, close_scope
from shuttle.apply.param_merge import copy_param, restore_param
from shuttle.apply.pipeline import Pipeline, as_model
from shuttle.apply.plan import (
    AdapterList,
    MergePlan,
    Mode,
    check_mode,
    plan_merge,
)
from shuttle.apply.rounding import Rounding, check_rounding
from shuttle.apply.sharded import agreed, has_dtensors, localize, merge_fingerprint
from shuttle.apply.widen import narrow, widen_layers
from shuttle.errors import InvalidOptionError, UnsupportedPlacementError
from shuttle.targets import KeyMapping

__all__ = ["apply_lora"]

@contextlib.contextmanager
def apply_lora(
    model: torch.nn.Module | Pipeline,
    loras: AdapterList,
    mode: Mode = "merge",
    *,
    rounding: Rounding | None = None,
    seed: int | None = None,
    mapping: KeyMapping | None = None,
    backup_device: torch.device | str | None = None,
    quality: Quality | None = None,
    auto_threshold: float = DEFAULT_THRESHOLD,
    strict: bool = False,
    names: Sequence[str] | None = None,
) -> Iterator[MergeReport | DynamicAdapters | AutoReport]:
    """Apply adapters for the duration of a ``with`` block.

    With ``mode="merge"`` the adapters are merged as by :func:`~shuttle.merge_lora`; a copy of
    every changed parameter is kept (on ``backup_device``, default the parameter's own) and
    copied back on exit, so the weights are bit-identical to before, also when the body raises.
    A layer the adapter widens (a FLUX.1 control LoRA's ``img_in``, see
    :mod:`shuttle.apply.widen`) gets its original weight tensor and ``in_features`` back.
    Only this mode widens; the others raise :class:`~shuttle.errors.WideningError`.
    With ``mode="dynamic"`` they are attached as by :func:`~shuttle.attach_lora` (weights never
    written) and detached on exit. With ``mode="auto"`` each parameter is merged where a merge
    in its dtype keeps the update (at most ``auto_threshold`` of the update's norm rounded away,
    see :func:`shuttle.apply.auto.decide`) and attached dynamically otherwise; both are undone
    on exit.

    Args:
        model: the model.
        loras: ``[(lora, strength), ...]``.
        mode: ``"merge"``, ``"dynamic"`` or ``"auto"``.
        rounding, seed, mapping: as for :func:`~shuttle.merge_lora`.
        backup_device: where to keep the originals (``"cpu"`` saves device memory).
        quality: the dynamic tier (``"exact"``, ``"lossless"``, ``"fused"``).
        auto_threshold: with ``mode="auto"``, the largest fraction of a parameter's update a
            merge may lose to rounding (0 merges only where rounding loses nothing).
        strict: every adapter key must reach a parameter, else
            :class:`~shuttle.errors.UnmatchedKeysError` before the block runs (in dynamic
            mode the hooks just attached are detached first; no weight is ever written there).
        names: with ``mode="dynamic"``, the adapters' names, as for :func:`~shuttle.attach_lora`.

    Yields:
        The :class:`~shuttle.MergeReport` (merge), the :class:`~shuttle.DynamicAdapters`
        handle (dynamic: change strengths with ``set_strength``), or an
        :class:`~shuttle.apply.auto.AutoReport` (auto: ``decisions``, ``losses``, ``dynamic``).

    Raises:
        InvalidOptionError: ``mode`` is not one of :data:`MODES`.
        ShuttleError: everything :func:`~shuttle.merge_lora` raises, before any change.
        InvalidStrengthError: ``auto_threshold`` is not a finite number >= 0.
    """
    check_mode(mode, "apply_lora")
    if names is not None and mode != "dynamic":
        raise InvalidOptionError(
            f"names= with mode={mode!r}: names are for the handle of mode='dynamic' (or "
            "attach_lora); leave names out")
    model = as_model(model)
    if mode == "dynamic":
        handle = attach_lora(model, loras, quality=quality, mapping=mapping, names=names)
        if strict and handle.unmatched:
            handle.detach()
            check_landed(MergePlan({}, dict(handle.unmatched), {}), strict=True)
        try:
            yield handle
        finally:
            handle.detach()
        return
    rounding = check_rounding(rounding)
    if mode == "auto":
        auto_threshold = check_threshold(auto_threshold)
        quality = quality or default_quality(model)
        if quality not in QUALITIES:
            raise InvalidOptionError(f"quality={quality!r}: expected one of {', '.join(QUALITIES)}")
    params = dict(model.named_parameters())
    if mode != "merge" and has_dtensors(params):
        raise UnsupportedPlacementError(
            f"apply_lora(mode={mode!r}) on a model with DTensor parameters: sharded models take "
            "mode='merge' (each rank merges its shards), or mode='dynamic' for low-rank "
            "adapters on tensor-parallel Linear layers")
    plan, sharded = agreed(params, lambda: _plan_local(model, params, loras, mapping, mode,
                                                       strict, rounding, seed),
                           lambda r: merge_fingerprint(r[0], rounding, seed))
    merged, dynamic = plan, None
    notes = plan_notes(plan)
    report: MergeReport | AutoReport = MergeReport(list(plan.params), plan.unmatched,
                                                   plan.skipped, notes)
    if mode == "auto":
        decisions = decide(plan, params, auto_threshold, rounding=rounding, seed=seed,
                           tied=tied_parameters(model).keys())
        merged = dataclasses.replace(plan, params={
            n: cs for n, cs in plan.params.items() if decisions[n].mode == "merge"})
        dynamic = dataclasses.replace(plan, params={
            n: cs for n, cs in plan.params.items() if decisions[n].mode == "dynamic"})
    if sharded is not None:  # DTensor parameters: their local shards and update windows
        merged, params = sharded
    check_mergeable(merged, params)  # before any backup or hook
    # a widened weight needs no copy: narrow() gives back the original tensor, never written
    backups = {name: copy_param(params[name], backup_device) for name in merged.params
               if name not in plan.widen}
    handle: DynamicAdapters | None = None
    widened = widen_layers(model, plan, params)  # checks every layer before widening one
    scope = MergeScope(backups, widened)
    OPEN_SCOPES.setdefault(model, []).append(scope)
    try:
        if dynamic is not None:
            # Hooks first: attaching validates every dynamic patch and writes no weight, and
            # the hooks' residuals are computed from the unmerged weights they belong to.
            handle = attach_plan(model, dynamic, quality, None)
            report = AutoReport({n: d.mode for n, d in decisions.items()},
                                {n: d.loss for n, d in decisions.items()}, handle,
                                plan.unmatched, plan.skipped, notes)
        merge_plan(model, merged, rounding=rounding, seed=seed, rollback=False,  # see finally
                   params=params)
        yield report
    finally:
        if handle is not None:
            handle.detach()
        close_scope(model, scope)
        for name, saved in backups.items():
            restore_param(params[name], saved)
        narrow(widened)


def _plan_local(model: torch.nn.Module, params: dict[str, torch.Tensor], loras: AdapterList,
                mapping: KeyMapping | None, mode: str, strict: bool, rounding: Rounding | None,
                seed: int | None
                ) -> tuple[MergePlan, tuple[MergePlan, dict[str, torch.Tensor]] | None]:
    """The plan, and for a model with DTensor parameters its local plan and tensors."""
    plan = plan_merge(model, loras, mapping, widen=mode == "merge", strict=strict)
    if not has_dtensors(params):
        return plan, None
    return plan, localize(plan, params, rounding=rounding, seed=seed)


