"""``mode="auto"``: merge where the weight's dtype keeps the update, stay dynamic where it does not.

A merge writes ``round_d(W + Δ)`` in the weight's dtype ``d``, so the update the model actually
gets is ``round_d(W + Δ) - W``. The fraction of the update lost to that rounding is

    loss = ||round_d(W + Δ) - (W + Δ)|| / ||Δ||          (Frobenius norms, float32)

with ``Δ`` the float32 update of all contributions to the parameter. A float32 weight loses
nothing (loss 0); a bfloat16 weight with 8 significand bits loses about ``2^-9 |W| / |Δ|``, so a
strength-0.1 LoRA whose update is 1% of the weight is mostly rounded away while a large update
survives. Parameters with ``loss <= threshold`` are merged (no forward cost); the others run
dynamically (their update is added at forward time in float32, losing nothing).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Collection, Mapping
from typing import Literal

import torch

from shuttle.apply.dynamic import DynamicAdapters
from shuttle.apply.notes import Note
from shuttle.apply.param_merge import apply_contributions, compute_dtype
from shuttle.apply.plan import MergePlan
from shuttle.apply.rounding import Rounding, round_to
from shuttle.errors import InvalidStrengthError

__all__ = ["DEFAULT_THRESHOLD", "AutoReport", "Decision", "check_threshold", "decide"]

log = logging.getLogger("shuttle")

DEFAULT_THRESHOLD = 0.05


@dataclasses.dataclass(frozen=True)
class Decision:
    """How one parameter is applied.

    Attributes:
        mode: ``"merge"`` or ``"dynamic"``.
        loss: the fraction of the update's norm a merge would round away (inf when the merge
            overflows the dtype, 0 when the update is zero).
    """

    mode: Literal["merge", "dynamic"]
    loss: float


@dataclasses.dataclass
class AutoReport:
    """What ``apply_lora(..., mode="auto")`` did.

    Attributes:
        decisions: parameter name -> ``"merge"`` or ``"dynamic"``.
        losses: parameter name -> the measured loss the decision was made on.
        dynamic: the handle of the dynamically attached part (its ``set_strength`` and
            :func:`~shuttle.lora_scale` reach only the dynamic parameters: merged ones are fixed).
        unmatched: adapter keys that reached no parameter -> why.
        skipped: adapter keys that were not turned into patches -> why.
        notes: where the update differs on purpose from a peer tool's, as in
            :class:`~shuttle.MergeReport`.
    """

    decisions: dict[str, str]
    losses: dict[str, float]
    dynamic: DynamicAdapters
    unmatched: dict[str, str]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[Note] = dataclasses.field(default_factory=list)

    @property
    def applied(self) -> list[str]:
        """Every parameter with an update, merged or dynamic."""
        return list(self.decisions)

    @property
    def merged(self) -> list[str]:
        """Parameters merged into the weights."""
        return [n for n, d in self.decisions.items() if d == "merge"]


def check_threshold(threshold: float) -> float:
    """``threshold`` as a float.

    Raises:
        InvalidStrengthError: not a finite number >= 0.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) \
            or not math.isfinite(float(threshold)) or threshold < 0:
        raise InvalidStrengthError(
            f"auto_threshold={threshold!r}: pass a finite number >= 0, the fraction of an "
            f"update's norm a merge may round away (default {DEFAULT_THRESHOLD})"
        )
    return float(threshold)


def decide(
    plan: MergePlan,
    params: Mapping[str, torch.Tensor],
    threshold: float = DEFAULT_THRESHOLD,
    *,
    rounding: Rounding | None = None,
    seed: int | None = None,
    tied: Collection[str] = (),
) -> dict[str, Decision]:
    """Measure, per parameter of ``plan``, how much of its update a merge would lose.

    The merge measured is the one ``merge_lora`` would do (float32 sum of the contributions,
    one rounding by ``rounding`` and ``seed``); nothing is written.

    Args:
        plan: a loaded plan (:func:`~shuttle.apply.plan.plan_merge`).
        params: parameter name -> tensor, for every parameter of the plan.
        threshold: merge where ``loss <= threshold``.
        rounding, seed: as for :func:`~shuttle.merge_lora`.
        tied: parameters other modules share (tied embeddings): merged whatever they lose,
            since a dynamic update would reach one module's forward only.

    Returns:
        parameter name -> :class:`Decision`, in plan order; also logged (``shuttle``, info).

    Raises:
        InvalidStrengthError: ``threshold`` is not a finite number >= 0.
    """
    threshold = check_threshold(threshold)
    out: dict[str, Decision] = {}
    with torch.no_grad():
        for name, contribs in plan.params.items():
            p = params[name]
            compute = compute_dtype(p.dtype, contribs)
            w0 = p.detach().to(compute)
            w = apply_contributions(w0.clone(), contribs)  # as merge_param's float path
            lost = round_to(w, p.dtype, rounding, name, seed, contribs).to(compute) - w
            update = float(torch.linalg.vector_norm(w - w0))
            err = float(torch.linalg.vector_norm(lost))
            # A merge that overflows (err non-finite) cannot be merged; a zero update loses nothing.
            loss = math.inf if not math.isfinite(err) else err / update if update else 0.0
            out[name] = Decision("merge" if loss <= threshold or name in tied else "dynamic",
                                 loss)
            log.info("auto: %s -> %s (%.3g of the update lost to %s rounding)", name,
                     out[name].mode, loss, p.dtype)
    merged = sum(d.mode == "merge" for d in out.values())
    log.info("auto: %d parameter(s) merged, %d dynamic (threshold %g)", merged,
             len(out) - merged, threshold)
    return out
