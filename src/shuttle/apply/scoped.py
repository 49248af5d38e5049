"""Scoped application: ``with apply_lora(model, loras): ...`` restores every weight bit for bit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch

from shuttle.apply.dynamic import DynamicAdapters, attach_lora
from shuttle.apply.dynamic_layer import Quality
from shuttle.apply.merge import MergeReport, merge_plan
from shuttle.apply.plan import AdapterList, plan_merge
from shuttle.apply.rounding import Rounding
from shuttle.errors import InvalidStrengthError, ShuttleError
from shuttle.targets import KeyMapping

__all__ = ["apply_lora"]

Mode = Literal["merge", "dynamic"]
MODES: tuple[str, ...] = ("merge", "dynamic")


@contextlib.contextmanager
def apply_lora(
    model: torch.nn.Module,
    loras: AdapterList,
    mode: Mode = "merge",
    *,
    rounding: Rounding = "nearest",
    seed: int | None = None,
    mapping: KeyMapping | None = None,
    backup_device: torch.device | str | None = None,
    quality: Quality | None = None,
) -> Iterator[MergeReport | DynamicAdapters]:
    """Apply adapters for the duration of a ``with`` block.

    With ``mode="merge"`` the adapters are merged as by :func:`~shuttle.merge_lora`; a copy of
    every changed parameter is kept (on ``backup_device``, default the parameter's own) and
    copied back on exit, so the weights are bit-identical to before, also when the body raises.
    With ``mode="dynamic"`` they are attached as by :func:`~shuttle.attach_lora` (weights never
    written) and detached on exit.

    Args:
        model: the model.
        loras: ``[(lora, strength), ...]``.
        mode: ``"merge"`` or ``"dynamic"``.
        rounding, seed, mapping: as for :func:`~shuttle.merge_lora`.
        backup_device: where to keep the originals (``"cpu"`` saves device memory).
        quality: the dynamic tier (``"exact"``, ``"lossless"``, ``"fused"``).

    Yields:
        The :class:`~shuttle.MergeReport` (merge), or the :class:`~shuttle.DynamicAdapters`
        handle (dynamic: change strengths with ``set_strength``).

    Raises:
        ShuttleError: ``mode`` is not one of the implemented modes; plus everything
            :func:`~shuttle.merge_lora` raises, before any change.
    """
    if mode not in MODES:
        raise ShuttleError(f"mode={mode!r}: apply_lora supports {', '.join(MODES)}")
    if mode == "dynamic":
        handle = attach_lora(model, loras, quality=quality, mapping=mapping)
        try:
            yield handle
        finally:
            handle.detach()
        return
    if rounding not in ("nearest", "stochastic"):
        raise InvalidStrengthError(f"rounding={rounding!r}: expected 'nearest' or 'stochastic'")
    plan = plan_merge(model, loras, mapping)
    params = dict(model.named_parameters())
    backups = {
        name: params[name].detach().to(backup_device or params[name].device, copy=True)
        for name in plan.params
    }
    try:
        merge_plan(model, plan, rounding=rounding, seed=seed)
        yield MergeReport(list(plan.params), plan.unmatched, plan.skipped)
    finally:
        with torch.no_grad():
            for name, saved in backups.items():
                params[name].copy_(saved)
