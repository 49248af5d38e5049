"""Plan a merge: resolve every adapter, validate every target, read every tensor, change nothing.

Everything that can fail because of the input fails here, before the first weight changes:
strengths, shapes, duplicate targets, capabilities, unreadable or non-finite adapter tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Literal, NamedTuple, Protocol

import torch

from shuttle.apply.checks import check_finite, check_landed, representation_of
from shuttle.apply.memo import MergeMemo, memo_of
from shuttle.apply.strength import check_strength
from shuttle.errors import (
    InvalidOptionError,
    InvalidStrengthError,
    ShapeMismatchError,
    ShuttleError,
    UnsupportedLayerError,
    UnsupportedPlacementError,
    WideningError,
)
from shuttle.formats import LoRA, load_lora
from shuttle.formats.source import Source
from shuttle.kernels.rounding import GlobalDraws
from shuttle.patches import DoRA, Patch
from shuttle.targets import (
    KeyMapping,
    ModelNames,
    Target,
    fused_modules,
    resolve,
    transposed_modules,
)
from shuttle.targets.family import widenable
from shuttle.weights.dtensor import is_dtensor
from shuttle.weights.plain import is_plain_tensor

__all__ = [
    "MODES",
    "Mode",
    "AdapterList",
    "Contribution",
    "MergePlan",
    "ParamSpec",
    "TensorSpec",
    "check_mode",
    "logical_spec",
    "normalize_adapters",
    "normalize_loras",
    "plan_merge",
    "plan_params",
]

Mode = Literal["merge", "dynamic", "auto"]
MODES: tuple[str, ...] = ("merge", "dynamic", "auto")


def check_mode(mode: object, where: str) -> None:
    """The one check of an adapter ``mode=`` for every entry point that takes one.

    Args:
        mode: what the caller passed.
        where: the entry point, as the message names it (``"apply_lora"``, ...).

    Raises:
        InvalidOptionError: ``mode`` is none of :data:`MODES`; the message lists them.
    """
    if not isinstance(mode, str) or mode not in MODES:
        raise InvalidOptionError(
            f"{where}: mode={mode!r}: expected 'merge' (folded into the weights), 'dynamic' "
            "(added at forward time, weights untouched) or 'auto' (merged where the weight's "
            "dtype keeps the update, dynamic elsewhere)")


log = logging.getLogger("shuttle")

# A strength per adapter, or per component (``{"transformer": 0.8, "text_encoder": 0.5}``:
# the first component of each parameter's name; components not named get 1).
Strength = float | Mapping[str, float]
AdapterList = Sequence[tuple["LoRA | Source", Strength]] | LoRA


@dataclasses.dataclass(frozen=True)
class Contribution:
    """One loaded patch at one strength on (rows of) one parameter."""

    patch: Patch
    strength: float
    rows: tuple[int, int] | None
    module_key: str
    adapter: int = 0  # index of its adapter among the (non-zero) adapters of the plan


@dataclasses.dataclass
class MergePlan:
    """Validated work: parameter name -> contributions in application order.

    ``widen``: parameters whose contributions take more input columns than they have (a
    control LoRA's ``img_in``) -> the shape they are validated at and must be widened to
    (:mod:`shuttle.apply.widen`) before the merge; only when planned with ``widen=True``.
    ``components``: adapter index -> its strength per component, for adapters given one
    (their entry in ``adapters`` has strength 1; each contribution carries its own).
    ``memo``: the model's :class:`~shuttle.apply.memo.MergeMemo` (placements and finite
    verdicts reused, ``max |t|`` of the checked adapter tensors), or a fresh one.
    ``draws``: parameters (DTensor shards, :func:`~shuttle.apply.sharded.localize`) whose
    stochastic rounding draws by global element index, with the global seed and window.
    """

    params: dict[str, list[Contribution]]
    unmatched: dict[str, str]
    skipped: dict[str, str]
    adapters: list[tuple[LoRA, float]] = dataclasses.field(default_factory=list)
    widen: dict[str, torch.Size] = dataclasses.field(default_factory=dict)
    components: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    memo: MergeMemo = dataclasses.field(default_factory=MergeMemo, repr=False, compare=False)
    draws: dict[str, GlobalDraws] = dataclasses.field(default_factory=dict)


def normalize_loras(loras: AdapterList) -> list[tuple[LoRA, float]]:
    """``[(LoRA, strength)]`` from user input, with strengths checked and zeros dropped.

    Raises:
        InvalidStrengthError: a strength is not a real number within float32's range
            (:func:`~shuttle.apply.strength.check_strength`), or is a per-component dict
            (only merges take those: see :func:`normalize_adapters`).
    """
    pairs, per_component = normalize_adapters(loras)
    if per_component:
        i = next(iter(per_component))
        raise InvalidStrengthError(
            f"loras[{i}] has a strength per component; only merges (merge_lora, "
            "apply_lora(mode='merge'), load_checkpoint, merge_files) take those: pass one "
            "number, or give each component its own adapter list")
    return pairs


def normalize_adapters(loras: AdapterList
                       ) -> tuple[list[tuple[LoRA, float]], dict[int, dict[str, float]]]:
    """:func:`normalize_loras` that also takes per-component strengths: returns the pairs (a
    per-component adapter at strength 1) and, by pair index, its strengths per component.

    Raises:
        InvalidStrengthError: a strength (or a component's) is not a real number within
            float32's range, or a component name is not a string.
    """
    if isinstance(loras, LoRA):
        loras = [(loras, 1.0)]
    out: list[tuple[LoRA, float]] = []
    per_component: dict[int, dict[str, float]] = {}
    for i, item in enumerate(loras):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise InvalidStrengthError(
                f"loras[{i}] is {type(item).__name__}; pass a list of (lora, strength) pairs, "
                "e.g. [(lora, 0.8)]"
            )
        lora, strength = item
        if isinstance(strength, Mapping):
            parts = {}
            for name, s in strength.items():
                if not isinstance(name, str):
                    raise InvalidStrengthError(
                        f"loras[{i}] strength: key {name!r} is not a component name; pass "
                        '{"transformer": 0.8, "text_encoder": 0.5}')
                parts[name] = check_strength(s, f"loras[{i}] strength[{name!r}]")
            per_component[len(out)] = parts
            out.append((load_lora(lora), 1.0))
            continue
        strength = check_strength(strength, f"loras[{i}] strength")
        if strength == 0:
            continue  # exact zeros are skipped: nothing to read, nothing to round
        out.append((load_lora(lora), strength))
    return out, per_component


class ParamSpec(NamedTuple):
    """A parameter as planning sees it without the tensor: a checkpoint header's entry."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")


class TensorSpec(Protocol):
    """What planning needs of a parameter: a tensor, or any object with these attributes."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...


def plan_merge(
    model: torch.nn.Module,
    loras: AdapterList,
    mapping: KeyMapping | None = None,
    *,
    widen: bool = False,
    strict: bool = False,
) -> MergePlan:
    """Resolve, validate and load everything a merge needs (tensors land on each weight's device).

    ``widen``, ``strict``: as for :func:`plan_params`.

    Raises:
        InvalidStrengthError, ShapeMismatchError, DuplicateTargetError, UnsupportedLayerError,
        NonFiniteAdapterError, CorruptFileError, WideningError, UnmatchedKeysError: see the
        messages; the model is untouched.
    """
    return plan_params(dict(model.named_parameters()), loras, mapping,
                       fused=fused_modules(model), transposed=transposed_modules(model),
                       widen=widen, strict=strict, memo=memo_of(model))


def plan_params(
    params: Mapping[str, TensorSpec],
    loras: AdapterList,
    mapping: KeyMapping | None = None,
    *,
    device: torch.device | str | None = None,
    load: bool = True,
    fused: Collection[str] = (),
    transposed: Collection[str] | None = None,
    widen: bool = False,
    strict: bool = False,
    memo: MergeMemo | None = None,
) -> MergePlan:
    """:func:`plan_merge` over parameter specs instead of a model (a checkpoint's header, ...).

    Args:
        params: parameter name -> tensor or :class:`TensorSpec`.
        loras, mapping: as for :func:`plan_merge`.
        device: where to read the patches (default: each parameter's device; required for
            parameters on the ``meta`` device).
        load: read the patches and check them finite; with False they stay lazy (and
            ``device`` is ignored), for planning without reading tensors.
        fused: modules running fused projections beside their split ones
            (:func:`~shuttle.targets.fused_modules` of the model): updates of the split layers
            go to the rows of the fused layer the forward reads.
        transposed: modules storing stacked experts (experts, in, out)
            (:func:`~shuttle.targets.transposed_modules` of the model), which places PEFT
            ``target_parameters`` updates; None: no model, only shapes (a checkpoint).
        widen: accept updates with more input columns than their 2-D weight (a control
            LoRA's ``img_in``), validated at the wider shape and listed in ``plan.widen``;
            the caller widens the layers before merging (:mod:`shuttle.apply.widen`).
        strict: every adapter key must reach a parameter (see :func:`check_landed`).
        memo: the model's :class:`~shuttle.apply.memo.MergeMemo` (:func:`memo_of`), where
            placements and finite verdicts are reused and kept; None: a fresh one.

    Raises:
        WideningError: without ``widen``, an update takes more input columns than its weight.
        UnmatchedKeysError: with ``strict``, an adapter key reaches no parameter (raised
            before any adapter tensor is read).
    """
    pairs, per_component = normalize_adapters(loras)
    # Quantized weights are planned by the weight they stand for (shape, compute dtype).
    params = {n: logical_spec(p) for n, p in params.items()}
    _check_components(per_component, params)
    signature = ((_signature(params), frozenset(fused),
                  None if transposed is None else frozenset(transposed))
                 if mapping is None else None)
    names: ModelNames | None = None
    memo = memo if memo is not None else MergeMemo()
    plan = MergePlan({}, {}, {}, pairs, components=per_component, memo=memo)
    several = len(pairs) > 1
    staged: list[tuple[_Placed, float, int]] = []
    for index, (lora, strength) in enumerate(pairs):
        placed = _cached_placement(memo, lora, signature)
        if placed is None:
            if names is None:
                names = ModelNames({n: p.shape for n, p in params.items()}, fused, transposed)
            res = resolve(lora, names, mapping)
            wide = _widened(res.targets, params, widenable(names))
            for t in res.targets:
                _validate(t, params[t.param], wide.get(t.param))
            placed = _Placed(res.targets, res.unmatched, [None] * len(res.targets), wide)
            if signature is not None:
                _remember_placement(memo, lora, signature, placed)
        if placed.widen and not widen:
            _refuse_widening(placed)
        for name, shape in placed.widen.items():
            if plan.widen.setdefault(name, shape) != shape:
                raise ShapeMismatchError(
                    f"two adapters widen {name!r} differently, to {tuple(plan.widen[name])} and "
                    f"{tuple(shape)}; merge them one at a time. Nothing was changed.")
        tag = f"{lora.source}::" if several else ""
        plan.unmatched.update({tag + k: v for k, v in placed.unmatched.items()})
        plan.skipped.update({tag + k: v for k, v in lora.skipped.items()})
        staged.append((placed, strength, index))
    if plan.widen:  # every adapter's updates of a widened weight must fit its new width
        for placed, _, _ in staged:
            for t in placed.targets:
                if t.param in plan.widen and placed.widen.get(t.param) is None:
                    _validate(t, params[t.param], plan.widen[t.param])
    check_landed(plan, strict, targets=sum(len(p.targets) for p, _, _ in staged))
    for placed, strength, index in staged:
        parts = per_component.get(index)
        for i, t in enumerate(placed.targets):
            if parts is not None:
                strength = parts.get(t.param.split(".", 1)[0], 1.0)
                if strength == 0:
                    continue
            patch = t.patch
            if load:
                target = torch.device(device) if device is not None else params[t.param].device
                if placed.resident[i] != target:
                    if target.type == "meta":
                        raise UnsupportedLayerError(
                            f"parameter {t.param!r} is on the meta device, with no weight to "
                            "merge into: materialize the model first (load its weights, e.g. "
                            "load_state_dict(..., assign=True)), or have "
                            "shuttle.load_checkpoint(model, files, loras=[...]) merge the "
                            "adapters as the checkpoint's weights land"
                        )
                    patch = patch.load(target)
                    if patch is t.patch:  # every tensor real and already there: next time too
                        placed.resident[i] = target
            plan.params.setdefault(t.param, []).append(
                Contribution(patch, strength, t.rows, t.module_key, index))
    _refuse_dtensor_factors(plan)
    if load:
        check_finite(plan)
    if plan.unmatched:
        log.warning("%d adapter key(s) matched no parameter: %s", len(plan.unmatched),
                    "; ".join(f"{k}: {v}" for k, v in list(plan.unmatched.items())[:5]))
    return plan


def _refuse_dtensor_factors(plan: MergePlan) -> None:
    for name, contribs in plan.params.items():
        for c in contribs:
            for field, t in c.patch.tensors():
                if is_dtensor(t):
                    raise UnsupportedPlacementError(
                        f"the adapter's {field!r} for {name!r} ({c.module_key!r}) is a DTensor: "
                        "adapter factors are read whole on every rank; pass plain tensors "
                        "(each rank takes the rows or columns its shard needs)")


def _check_components(per_component: dict[int, dict[str, float]],
                      params: Mapping[str, TensorSpec]) -> None:
    """Every component a per-component strength names is a top-level module of the model."""
    if not per_component:
        return
    components = {n.split(".", 1)[0] for n in params}
    for parts in per_component.values():
        unknown = sorted(set(parts) - components)
        if unknown:
            raise InvalidStrengthError(
                f"a per-component strength names {unknown} that the model does not have; its "
                f"components (top-level modules) are {sorted(components)[:12]}. Merge into the "
                "pipeline (merge_lora(pipe, ...)) to name its components")


@dataclasses.dataclass
class _Placed:
    """One adapter resolved onto one set of parameter specs, every target validated.

    ``resident[i]``: the device that target ``i``'s patch is known to live on whole (loading
    it there returns it as is), or None.
    """

    targets: list[Target]
    unmatched: dict[str, str]
    resident: list[torch.device | None]
    widen: dict[str, torch.Size] = dataclasses.field(default_factory=dict)


def _signature(params: Mapping[str, TensorSpec]) -> tuple:
    """What resolution and validation read of the parameters: names, shapes, float or not."""
    return tuple((n, tuple(p.shape), p.dtype.is_floating_point) for n, p in params.items())


def _patch_ids(lora: LoRA) -> tuple:
    # a placement's targets hold these patches: their ids stay unique while it is kept
    return tuple(id(p) for _, p in lora.patches())


def _cached_placement(memo: MergeMemo, lora: LoRA, signature: tuple | None) -> _Placed | None:
    """The adapter's last placement in this model, when it holds for ``signature`` (names,
    shapes and dtype kinds of the parameters) and the adapter's same patch objects; a caller's
    mapping is never cached (it may be a function): ``signature`` is None then.
    """
    if signature is None:
        return None
    entry = memo.placements.get(lora)
    if entry is None or entry[0] != signature or entry[1] != _patch_ids(lora):
        return None
    return entry[2]


def _remember_placement(memo: MergeMemo, lora: LoRA, signature: tuple, placed: _Placed
                        ) -> None:
    memo.placements[lora] = (signature, _patch_ids(lora), placed)


def logical_spec(p: TensorSpec) -> TensorSpec:
    """What planning validates a parameter as: itself, or for a quantized weight (a tensor a
    registered representation claims) a :class:`ParamSpec` of its logical shape and compute
    dtype. A tensor no representation claims (an integer tensor) is returned as is, and
    ``_validate`` rejects it by dtype when targeted.
    """
    if not isinstance(p, torch.Tensor) or is_plain_tensor(p):
        return p
    try:
        rep = representation_of(p)
    except ShuttleError:  # unclaimed, or claimed but unreadable: merging says why
        return p
    return p if rep is None else ParamSpec(rep.logical_shape, rep.compute_dtype, rep.device)


def _widened(targets: list[Target], params: Mapping[str, TensorSpec],
             allowed: Collection[str]) -> dict[str, torch.Size]:
    """Weights that an adapter's updates widen: name -> (out, in') with in' > in columns.

    A FLUX.1 control LoRA (Canny, Depth) feeds the control image's latents in beside the
    noisy ones: its ``img_in`` factors take (3072, 128) where the model has (3072, 64). Only
    weights a model family lets widen (``allowed``: :func:`~shuttle.targets.family.widenable`)
    count, whole and 2-D, where the update's rows match; the widest update sets the width,
    and a narrower one then fails its shape check. Any other weight keeps its shape, and an
    update of another width there is an adapter for another model (a shape mismatch).
    """
    wide: dict[str, torch.Size] = {}
    for t in targets:
        if t.param not in allowed:
            continue
        shape = params[t.param].shape
        cols = t.patch.in_columns
        if t.rows is None and len(shape) == 2 and cols is not None and cols > shape[1] \
                and t.patch.out_rows == shape[0]:
            wide[t.param] = torch.Size((shape[0], max(cols, wide.get(t.param, shape)[1])))
    return wide


def _refuse_widening(placed: _Placed) -> None:
    name, shape = next(iter(placed.widen.items()))
    key = next(t.module_key for t in placed.targets if t.param == name)
    raise WideningError(
        f"adapter module {key!r} takes {shape[1]} input features where {name!r} has fewer: it "
        "widens the layer (a control LoRA adds input channels for its control image). Only a "
        "merge widens a layer: use shuttle.merge_lora(...) or apply_lora(..., mode=\"merge\"). "
        "Nothing was changed."
    )


def _validate(t: Target, p: TensorSpec, wide: torch.Size | None = None) -> None:
    shape = tuple(p.shape if wide is None else wide)
    if t.rows is not None:
        start, end = t.rows
        if not 0 <= start < end <= shape[0]:
            raise ShuttleError(f"rows {t.rows} of {t.param!r} are outside its {shape[0]} rows")
        shape = (end - start, *shape[1:])
        if isinstance(t.patch, DoRA) and t.patch.magnitude.shape[0] != shape[0]:
            raise UnsupportedLayerError(
                f"{t.module_key!r}: a DoRA patch with input-axis norms cannot update a slice of "
                f"fused {t.param!r}; split the fused layer or merge another adapter format."
            )
    if not p.dtype.is_floating_point:
        raise UnsupportedLayerError(
            f"parameter {t.param!r} has dtype {p.dtype}; merging needs a floating-point weight "
            "(quantized weights: use dynamic mode)"
        )
    t.patch.check(shape, t.param)


