"""The checks a merge plan passes before any weight changes: adapters that reach no parameter
(:func:`check_landed`), parameters that cannot take a merge (:func:`check_mergeable`), and
non-finite adapter tensors (:func:`check_finite`).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from shuttle.errors import (
    NonFiniteAdapterError,
    ShuttleError,
    UnmatchedKeysError,
    UnmergeableWeightError,
    UnsupportedLayerError,
)
from shuttle.patches import materialize
from shuttle.weights import Fp8Weight, PlainWeight, WeightRepresentation, represent
from shuttle.weights.plain import is_plain_tensor

if TYPE_CHECKING:
    from shuttle.apply.plan import MergePlan

__all__ = ["check_finite", "check_landed", "check_mergeable", "representation_of"]

log = logging.getLogger("shuttle")


def check_landed(plan: MergePlan, strict: bool, *, targets: int | None = None) -> None:
    """Refuse (``strict``) or warn loudly about adapters that miss the model.

    With ``strict``, every adapter key must reach a parameter: otherwise
    :class:`~shuttle.errors.UnmatchedKeysError` lists the keys that did not, with why. Keys
    that ``load_lora`` deliberately did not turn into patches (``plan.skipped``: PEFT's
    untouched originals, embeddings) are not weight updates and do not count. Without it, a
    plan in which adapters were given (at a non-zero strength) and none of their keys reaches
    a parameter is almost always an adapter made for another model: it is logged as a warning
    on the ``shuttle`` logger and raised as a :class:`UserWarning`.

    ``targets``: how many targets the plan will hold (default: ``len(plan.params)``).
    """
    if strict and plan.unmatched:
        keys = list(plan.unmatched.items())
        raise UnmatchedKeysError(
            f"strict=True: {len(keys)} adapter key(s) reached no parameter: "
            + "; ".join(f"{k}: {v}" for k, v in keys[:10])
            + (f"; ... ({len(keys) - 10} more in .unmatched)" if len(keys) > 10 else "")
            + ". Check that the adapter was made for this model (or pass a mapping); nothing "
            "was changed.", plan.unmatched)
    landed = len(plan.params) if targets is None else targets
    if plan.adapters and not landed:
        sources = ", ".join(repr(lora.source) for lora, _ in plan.adapters[:3])
        message = (
            f"NO adapter update landed: none of the {len(plan.unmatched)} key(s) of {sources} "
            "reached a parameter of this model, so nothing will change. The adapter was "
            "probably made for another model (or needs a mapping); see the report's "
            ".unmatched, or pass strict=True to make this an error.")
        log.warning(message)
        warnings.warn(message, UserWarning, stacklevel=4)


def representation_of(p: torch.Tensor) -> WeightRepresentation | None:
    """The representation of a non-plain tensor (quantized, sharded), or None where it is a
    plain/float8 one.
    """
    rep = represent(p)
    return None if isinstance(rep, (PlainWeight, Fp8Weight)) and is_plain_tensor(p) else rep


def check_mergeable(plan: MergePlan, params: Mapping[str, torch.Tensor]) -> None:
    """Raise before any write if a planned parameter cannot take a merge.

    A merge into a quantized parameter dequantizes, applies and re-encodes it, then writes the
    result back into the parameter object (``write_into``); a representation without
    re-encoding (``mergeable = False``) or without a way back into the parameter is refused.

    Raises:
        UnmergeableWeightError: names the parameter and points to dynamic mode.
    """
    for name in plan.params:
        p = params[name]
        if is_plain_tensor(p):
            continue
        try:
            rep = representation_of(p)
        except UnsupportedLayerError:
            raise
        except ShuttleError:
            rep = None
        if rep is None or not rep.mergeable or not rep.writable:
            what = type(p).__qualname__ if rep is None else type(rep).__qualname__
            raise UnmergeableWeightError(
                f"parameter {name!r} is a {what} weight, which cannot be re-encoded after a "
                "merge (its encoding is fixed offline, or no registered representation writes "
                'it back); apply the adapter with mode="dynamic" (shuttle.attach_lora) '
                "instead. Nothing was changed."
            )


def check_finite(plan: MergePlan) -> None:
    """Raise :class:`NonFiniteAdapterError` if any patch tensor of ``plan`` holds NaN or inf.

    Loaded tensors are checked on their device with one host sync per device (and skipped when
    already found finite and not modified since); lazy ones are read one at a time and dropped,
    so a plan that defers loading (a checkpoint load, a file merge) is checked without holding
    every adapter tensor at once. Each loaded tensor's ``max |t|`` is kept with its verdict
    (``plan.memo.known_abs_max``: merges bound their updates by it).
    """
    where, tensors = [], []
    for name, contribs in plan.params.items():
        for c in contribs:
            for field, t in c.patch.tensors():
                if not t.dtype.is_floating_point:
                    continue
                if not isinstance(t, torch.Tensor):
                    if not _finite(materialize(t)):
                        _raise_non_finite([(c.module_key, field, name)])
                elif not plan.memo.known_finite(t):
                    where.append((c.module_key, field, name))
                    tensors.append(t)
    if not tensors:
        return
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    bad, abs_max = [], [0.0] * len(tensors)
    for idx in by_device.values():
        maxima = _screen([tensors[i] for i in idx])
        for j, i in enumerate(idx):
            abs_max[i] = maxima[j]
            if not math.isfinite(maxima[j]) and not _finite(tensors[i]):
                bad.append(i)
    if bad:
        _raise_non_finite([where[i] for i in bad])
    for t, m in zip(tensors, abs_max, strict=True):
        plan.memo.mark_finite(t, m)


def _screen(tensors: list[torch.Tensor]) -> list[float]:
    """``max |t|`` of each of ``tensors`` (all on one device), in float32: one multi-tensor
    launch and one host sync for all of them (a kernel or two per tensor, issued from Python,
    cost more host time than merging the weights they update). The maximum propagates NaN
    (checked on CPU and CUDA by tests/apply/test_plan.py) and is infinite for an infinity; a
    tensor whose maximum is not finite gets the exact check.
    """
    # float8 has no reduction kernels: measured from its float32 values; float64 tensors are
    # measured in float64 (a reduction may not narrow them, and their maxima may exceed float32)
    wide = [i for i, t in enumerate(tensors) if t.dtype == torch.float64]
    rest = [i for i, t in enumerate(tensors) if t.dtype != torch.float64]
    out = [0.0] * len(tensors)
    if rest:
        ts = [tensors[i].float() if tensors[i].element_size() == 1 else tensors[i] for i in rest]
        for i, m in zip(rest, torch.stack(torch._foreach_norm(ts, math.inf, dtype=torch.float32))
                        .tolist(), strict=True):
            out[i] = m
    if wide:
        norms = torch._foreach_norm([tensors[i] for i in wide], math.inf)
        for i, m in zip(wide, torch.stack(norms).tolist(), strict=True):
            out[i] = m
    return out


def _finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or infinity. ``aminmax`` propagates NaN and shows an infinity
    as an extreme, and is several times faster on the CPU than ``isfinite().all()``.
    """
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.float() if t.element_size() == 1 else t)  # float8: no aminmax
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _raise_non_finite(bad: list[tuple[str, str, str]]) -> None:
    key, field, name = bad[0]
    raise NonFiniteAdapterError(
        f"adapter module {key!r} tensor {field!r} (for {name!r}) holds NaN or infinity"
        f"{f', as do {len(bad) - 1} more' if len(bad) > 1 else ''}. The adapter is corrupt "
        "or diverged in training; nothing was changed."
    )
