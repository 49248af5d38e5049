"""Dynamic adapters: updates added at forward time, base weights untouched.

``attach_lora`` validates exactly as a merge does (nothing is attached when anything is wrong),
then installs one :class:`~shuttle.apply.dynamic_layer.LoRAHook` per adapted module. The returned
:class:`DynamicAdapters` changes strengths (in place: a compiled model does not recompile), swaps
an adapter for another of the same targets and rank, and detaches, leaving every module as it was.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import torch

from shuttle.apply.checks import check_finite
from shuttle.apply.dynamic_layer import LoRAHook, Quality
from shuttle.apply.memo import memo_of
from shuttle.apply.merge import MergeReport
from shuttle.apply.notes import Note, plan_notes
from shuttle.apply.pipeline import Pipeline, as_model
from shuttle.apply.plan import (
    AdapterList,
    Contribution,
    MergePlan,
    plan_merge,
    plan_params,
)
from shuttle.apply.strength import Strengths, check_strength
from shuttle.errors import (
    AdapterIndexError,
    InvalidOptionError,
    InvalidStrengthError,
    UnsupportedLayerError,
)
from shuttle.formats import LoRA, load_lora
from shuttle.hooks import add_hook, remove_hook
from shuttle.patches import PATCH_KINDS
from shuttle.targets import KeyMapping, fused_modules, transposed_modules
from shuttle.targets.split import Rows

__all__ = ["QUALITIES", "DynamicAdapters", "attach_lora", "attach_plan", "check_untied",
           "default_quality", "tied_parameters"]

QUALITIES: tuple[str, ...] = ("exact", "lossless", "fused", "auto")


def default_quality(model: torch.nn.Module) -> Quality:
    """The tier used when none is given: ``"auto"``, for every model.

    ``"auto"`` runs each low-rank Linear update by whichever of lossless, Triton fused and
    (with the ``hopper`` extra on an sm_90 GPU) CuTe fused measured fastest for that layer's
    shape on its device, eagerly or under CUDA graphs as the call runs
    (:mod:`shuttle.apply.tier`): never slower than lossless. Off CUDA it is lossless. Its
    results are lossless's or fused's, each within the tier's precision contract; pass a tier
    explicitly for one fixed numerical path.

    Args:
        model: the model the adapters go on. It is not read: it is in the signature so that the
            default can come to depend on the model without changing the callers.
    """
    return "auto"


class DynamicAdapters:
    """Adapters attached to a model for forward-time application.

    Each adapter has a name (``attach_lora(..., names=...)``, else its file's stem or
    ``adapter<i>``) and an index (its place in the list); every method takes either.

    Attributes:
        names: the adapters' names, in attach order.
        strengths: their strengths (:class:`~shuttle.apply.strength.Strengths`, a sequence of
            floats): the one copy every hook of this handle reads, with a generation of its
            own, so that changing them reaches this model's layers only.
        report: what was placed (``applied`` parameter names) and what was not.
        quality: the tier of low-rank Linear updates.
    """

    def __init__(self, model: torch.nn.Module, loras: list[LoRA], strengths: list[float],
                 quality: Quality, report: MergeReport, names: list[str] | None = None):
        self.model = model
        self.loras = loras
        self.strengths = Strengths(strengths)
        self.quality = quality
        self.report = report
        self.names = names if names is not None else default_names(loras)
        self.hooks: dict[str, LoRAHook] = {}
        self._mapping: KeyMapping | None = None  # how attach_lora placed them, for delete()
        self._max_rank: int | None = None

    @property
    def active(self) -> dict[str, float]:
        """Name -> strength of every adapter at a non-zero strength."""
        return {n: s for n, s in zip(self.names, self.strengths, strict=True) if s != 0}

    def set_adapters(self, names: Mapping[str | int, float] | Sequence[str | int] | str | int,
                     weights: float | Sequence[float] | None = None) -> None:
        """Set the named (or indexed) adapters' strengths, every other adapter's to 0.

        As diffusers' ``set_adapters``, in both of its spellings::

            h.set_adapters({"style": 0.8, "detail": 0.3})
            h.set_adapters(["style", "detail"], [0.8, 0.3])
            h.set_adapters("style", 0.8)            # one adapter, the others off
            h.set_adapters(["style", "detail"])     # each at 1.0, as diffusers
            h.set_adapters(["style", "detail"], 0.5)  # the same weight for each

        Everything is checked before the first strength changes; an adapter set to 0 keeps its
        name and place, and comes back at the next non-zero strength.

        Args:
            names: a mapping name (or index) -> strength; or names (indices) with ``weights``.
            weights: with a list of names, a strength per name, or one for all (default 1.0).
                Per-block weights (diffusers' dicts) are not taken: one strength per adapter.

        Raises:
            AdapterIndexError: a name or index the handle does not hold, or one adapter named
                twice.
            InvalidStrengthError: a strength is not a real number within float32's range, the
                weights are not one per name, or a mapping comes with ``weights``.
        """
        self._set_strengths(self._wanted(names, weights, "set_adapters"), others=0.0)

    def _wanted(self, names: Mapping[str | int, float] | Sequence[str | int] | str | int,
                weights: float | Sequence[float] | None, method: str) -> dict[int, float]:
        """Index -> checked strength from ``set_adapters``' arguments (nothing changes)."""
        if isinstance(names, Mapping):
            if weights is not None:
                raise InvalidStrengthError(
                    f"{method}({names!r}, {weights!r}): a mapping carries its strengths; pass "
                    "either {name: strength} or names and weights")
            pairs = list(names.items())
        else:
            keys = [names] if isinstance(names, str | numbers.Integral) else names
            if not isinstance(keys, Sequence):
                raise AdapterIndexError(
                    f"{method}({names!r}, ...): pass a name, a list of names (or indices), or "
                    "a mapping {name: strength}")
            if weights is None:
                weights = [1.0] * len(keys)
            elif isinstance(weights, str) or not isinstance(weights, Sequence):
                weights = [weights] * len(keys)  # one for all (checked as each one below)
            if len(weights) != len(keys):
                raise InvalidStrengthError(
                    f"{method}: {len(keys)} name(s) {list(keys)!r} and {len(weights)} "
                    f"weight(s) {list(weights)!r}; pass one weight per name, or one float for "
                    "all")
            pairs = list(zip(keys, weights, strict=True))
        wanted: dict[int, float] = {}
        for key, weight in pairs:
            i = self._check_index(key, method)
            if i in wanted:
                raise AdapterIndexError(
                    f"{method}: adapter {i} ({self.names[i]!r}) is named twice (as {key!r}); "
                    "give each adapter once")
            wanted[i] = check_strength(weight, f"{method} strength of {key!r}")
        return wanted

    @property
    def applied(self) -> list[str]:
        """Parameter names with a dynamic update."""
        return self.report.applied

    @property
    def unmatched(self) -> dict[str, str]:
        """Adapter keys that reached no parameter, with why."""
        return self.report.unmatched

    @property
    def skipped(self) -> dict[str, str]:
        """Adapter keys ``load_lora`` did not turn into patches, with why."""
        return self.report.skipped

    @property
    def notes(self) -> list[Note]:
        """Where the update differs on purpose from a peer tool's."""
        return self.report.notes

    def strength_tensor(self, device: torch.device) -> torch.Tensor:
        """``(n_adapters,)`` float32 strengths on ``device`` (updated in place)."""
        return self.strengths.tensor(device)

    def set_strength(self, index: int | str, strength: float) -> None:
        """Change adapter ``index``'s (or name's) strength without rebuilding low-rank factors.

        Raises:
            InvalidStrengthError: ``strength`` is not a real number within float32's range
                (:func:`~shuttle.apply.strength.check_strength`).
            AdapterIndexError: no adapter ``index`` (or of that name).
        """
        index = self._check_index(index, "set_strength")
        self._set_strengths({index: check_strength(strength,
                                                   f"set_strength({index}, strength)")})

    def _set_strengths(self, wanted: dict[int, float], others: float | None = None) -> None:
        """Write checked strengths (adapter index -> strength; every other adapter's to
        ``others`` unless None), then recompute the weight residuals of the adapters changed.
        """
        if others is not None:
            wanted = {i: wanted.get(i, others) for i in range(len(self.loras))}
        self.strengths.set(wanted)
        modules = dict(self.model.named_modules())
        for name, hook in self.hooks.items():
            if any(c.adapter in wanted for cs in hook.dense.values() for c in cs):
                hook.refresh(modules[name])

    def _check_index(self, index: int | str, method: str) -> int:
        n = len(self.loras)
        if isinstance(index, str):
            if index not in self.names:
                raise AdapterIndexError(
                    f"{method}({index!r}, ...): no adapter of that name; this handle holds "
                    f"{self.names} (names from attach_lora(names=...) or the files' stems)")
            return self.names.index(index)
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) \
                or not -n <= index < n:
            raise AdapterIndexError(
                f"{method}({index!r}, ...): this handle holds {n} adapter(s), at indices "
                f"0..{n - 1} in the order attach_lora got them; pass one of those."
            )
        return int(index) % n

    def swap(self, index: int | str, lora: LoRA | str, mapping: KeyMapping | None = None
             ) -> MergeReport:
        """Replace adapter ``index`` by ``lora``, in place.

        ``lora`` must place low-rank weight patches on exactly the (module, rows) slots the
        attached adapter holds: a fused ``qkv`` weight carries one slot per row range (q, k, v
        keys of a split adapter), and each is swapped on its own rows. On a Linear, each new
        rank must be at most the slot's width (the attached rank, or ``max_rank``); factors are
        copied into the existing buffers, so a compiled model keeps its graphs. Conv and
        Embedding slots take the new patch as it is.

        Everything is resolved, validated and read before the first slot changes: on an error
        the attached adapter stays as it was.

        Returns:
            The new adapter's report: the parameters it reaches, its unmatched and skipped keys.

        Raises:
            UnsupportedLayerError: the new adapter reaches other slots than the attached one,
                holds another patch kind, or a rank above a slot's width; the attached one holds
                patches that run as weight residuals (LoHa, LoKr, diffs, ...). Each message
                says to ``detach()`` and attach the new adapter instead (or to attach with a
                larger ``max_rank``).
            AdapterIndexError: no adapter ``index``.
            Everything :func:`~shuttle.merge_lora` raises for a bad adapter (shapes, non-finite
                tensors, duplicate targets).
        """
        index = self._check_index(index, "swap")
        new = load_lora(lora)
        plan = plan_params(dict(self.model.named_parameters()), [(new, 1.0)], mapping,
                           load=False, fused=fused_modules(self.model),
                           transposed=transposed_modules(self.model), memo=memo_of(self.model))
        attached = self.loras[index].source
        fix = "detach() and attach_lora(...) the new adapter instead"
        dense = sorted(n for n, h in self.hooks.items()
                       if any(c.adapter == index for cs in h.dense.values() for c in cs))
        if dense:
            raise UnsupportedLayerError(
                f"swap replaces low-rank factors only, but adapter {index} ({attached}) runs "
                f"as a weight residual on {dense[:4]} (a patch other than low-rank on a "
                f"Linear/Conv/Embedding weight); {fix}"
            )
        # (module, rows) -> the new patch: a fused weight has one slot per row range
        wanted: dict[tuple[str, Rows | None], Contribution] = {}
        for param, contribs in plan.params.items():
            module, _, leaf = param.rpartition(".")
            for c in contribs:
                # the new patch in the low-rank form its kind runs beside a layer, if any
                lowrank = PATCH_KINDS[c.patch.kind].lowrank(c.patch)
                if leaf != "weight" or lowrank is None:
                    raise UnsupportedLayerError(
                        f"swap brings in low-rank weight patches only; {c.module_key!r} is a "
                        f"{c.patch.kind} patch on {param!r}; {fix}"
                    )
                assert (module, c.rows) not in wanted, f"two patches on {param!r} {c.rows}"
                wanted[(module, c.rows)] = dataclasses.replace(c, patch=lowrank)
        held = {(n, s.rows) for n, h in self.hooks.items() for s in h.slots if s.adapter == index}
        if set(wanted) != held:
            differ = sorted((f"{n} rows {r}" if r else n) for n, r in set(wanted) ^ held)
            raise UnsupportedLayerError(
                f"swap needs the same targets (modules and row ranges): the new adapter "
                f"reaches {len(wanted)}, adapter {index} ({attached}) holds {len(held)} "
                f"(differing: {differ[:4]}); {fix}"
            )
        modules = dict(self.model.named_modules())
        for (module, rows), c in wanted.items():  # raises before any change
            self.hooks[module].check_swap(modules[module], index, rows, c.patch)
        loaded: dict[str, list[Contribution]] = defaultdict(list)
        for (module, _), c in wanted.items():
            device = self.hooks[module].device or modules[module].weight.device
            loaded[f"{module}.weight"].append(dataclasses.replace(c, patch=c.patch.load(device)))
        check_finite(MergePlan(loaded, {}, {}))
        for param, contribs in loaded.items():
            self.hooks[param.rpartition(".")[0]].swap(index, {c.rows: c.patch for c in contribs})
        self.loras[index] = new
        self.strengths.bump()
        return MergeReport(list(plan.params), plan.unmatched, plan.skipped, plan_notes(plan))

    def delete(self, index: int | str) -> None:
        """Remove one adapter: the hooks are rebuilt for the others (at their strengths and
        names), and the model runs as if it had never been attached. A compiled model
        recompiles once.

        Raises:
            AdapterIndexError: no adapter ``index`` (or of that name).
        """
        index = self._check_index(index, "delete")
        keep = [i for i in range(len(self.loras)) if i != index]
        loras = [self.loras[i] for i in keep]
        strengths = [self.strengths[i] for i in keep]
        names = [self.names[i] for i in keep]
        self.detach()
        self.loras, self.strengths, self.names = loras, Strengths(strengths), names
        if not loras:
            self.report = MergeReport([], {}, {})
            return
        # The remaining adapters resolve as they did, planned at strength 1 (one at 0 through
        # set_adapters keeps its place) and then set to their strengths.
        plan = plan_merge(self.model, [(lora, 1.0) for lora in loras], self._mapping)
        rebuilt = attach_plan(self.model, plan, self.quality, self._max_rank, names)
        # the rebuilt hooks read the rebuilt handle's strengths: those become this handle's
        self.hooks, self.report, self.strengths = rebuilt.hooks, rebuilt.report, rebuilt.strengths
        self._set_strengths(dict(enumerate(strengths)))

    def detach(self) -> None:
        """Remove every hook; the model is exactly as before attaching."""
        modules = dict(self.model.named_modules())
        for name, hook in self.hooks.items():
            remove_hook(modules[name], hook)
        self.hooks.clear()


def attach_lora(
    model: torch.nn.Module | Pipeline,
    loras: AdapterList,
    *,
    quality: Quality | None = None,
    mapping: KeyMapping | None = None,
    max_rank: int | None = None,
    names: Sequence[str] | None = None,
) -> DynamicAdapters:
    """Attach adapters for forward-time application; returns a handle (call ``detach()``).

    Args:
        model: the model; its weights are never written.
        loras: ``[(lora, strength), ...]``. An adapter at strength 0 is attached too (read,
            validated and held on the device, its update computed at 0) so that
            ``set_strength``/``set_adapters`` can bring it back; leave it out of the list to
            skip it.
        quality: ``"exact"``, ``"lossless"``, ``"fused"`` or ``"auto"`` (the default: the
            fastest of lossless and fused per layer shape, measured; :func:`default_quality`).
        mapping: as for :func:`~shuttle.merge_lora`.
        max_rank: pad low-rank Linear slots to this rank so :meth:`DynamicAdapters.swap` can
            bring in adapters up to it without recompiling.
        names: a name per adapter, in order, for the handle's methods
            (default: each file's stem, ``adapter<i>`` for one in memory; repeats get ``_2``).

    Raises:
        Everything :func:`~shuttle.merge_lora` raises, before anything is attached;
        UnsupportedLayerError: a patch a layer cannot take dynamically.
    """
    model = as_model(model)
    quality = quality or default_quality(model)
    if quality not in QUALITIES:
        raise InvalidOptionError(f"quality={quality!r}: expected one of {', '.join(QUALITIES)}")
    # An adapter at strength 0 is planned (resolved, validated, loaded) as any other, then
    # attached at 0, so that a later strength brings it back under its name and index.
    zeros = _zero_strengths(loras)
    plan = plan_merge(model, [(item[0], 1.0) if i in zeros else item
                              for i, item in enumerate(loras)] if zeros else loras, mapping)
    for i in zeros:
        plan.adapters[i] = (plan.adapters[i][0], 0.0)
    handle = attach_plan(model, plan, quality, max_rank,
                         list(names) if names is not None else None)
    handle._mapping = mapping
    return handle


def _zero_strengths(loras: AdapterList) -> set[int]:
    """Indices of the ``(lora, strength)`` pairs whose strength is a valid 0 (anything else,
    valid or not, is :func:`~shuttle.apply.plan.plan_merge`'s to take or refuse).
    """
    if isinstance(loras, LoRA):
        return set()
    zeros = set()
    for i, item in enumerate(loras):
        if isinstance(item, tuple) and len(item) == 2 and not isinstance(item[1], Mapping):
            try:
                if check_strength(item[1]) == 0:
                    zeros.add(i)
            except InvalidStrengthError:
                pass
    return zeros


def default_names(loras: Sequence[LoRA]) -> list[str]:
    """A name per adapter: its file's stem, or ``adapter<i>`` for a state dict; a name taken
    already gets ``_2``, ``_3``, ...
    """
    out: list[str] = []
    for i, lora in enumerate(loras):
        stem = Path(lora.source.split(", ")[0]).stem if not lora.source.startswith("<") else ""
        name = base = stem or f"adapter{i}"
        k = 2
        while name in out:
            name, k = f"{base}_{k}", k + 1
        out.append(name)
    return out


def attach_plan(model: torch.nn.Module, plan: MergePlan, quality: Quality,
                max_rank: int | None = None, names: list[str] | None = None
                ) -> DynamicAdapters:
    """Attach a validated (and loaded) plan: :func:`attach_lora` after planning.

    ``plan.params`` may be a subset of a plan's parameters (``mode="auto"`` attaches the ones
    it does not merge); only those get hooks.

    Raises:
        UnsupportedLayerError: a patch a layer cannot take dynamically; nothing is attached.
    """
    if plan.components:
        i = next(iter(plan.components))
        raise InvalidStrengthError(
            f"loras[{i}] has a strength per component; dynamic adapters hold one strength per "
            "adapter: merge it (mode='merge'), or attach one adapter list per component")
    check_untied(model, plan.params)
    per_module: dict[str, dict[str, list[Contribution]]] = defaultdict(lambda: defaultdict(list))
    for param, contribs in plan.params.items():
        module, _, leaf = param.rpartition(".")
        per_module[module][leaf].extend(contribs)
    report = MergeReport(list(plan.params), plan.unmatched, plan.skipped, plan_notes(plan))
    # strengths live in a float32 tensor: refuse what it cannot hold (1e308 -> inf)
    strengths = [check_strength(s, f"loras[{i}] strength") for i, (_, s) in
                 enumerate(plan.adapters)]
    loras = [lora for lora, _ in plan.adapters]
    if names is not None and (len(names) != len(loras) or len(set(names)) != len(names)
                              or not all(isinstance(n, str) for n in names)):
        raise AdapterIndexError(
            f"names={names!r}: give one distinct string per adapter ({len(loras)} here)")
    handle = DynamicAdapters(model, loras, strengths, quality, report, names)
    handle._max_rank = max_rank
    modules = dict(model.named_modules())
    hooks = {name: LoRAHook(name, modules[name], dict(leaves), handle.strengths, quality,
                            max_rank)
             for name, leaves in per_module.items()}  # built first: a failure attaches nothing
    try:
        for name, hook in hooks.items():
            add_hook(modules[name], hook)
            handle.hooks[name] = hook
    except BaseException:
        handle.detach()  # roll back the hooks already installed
        raise
    return handle


def tied_parameters(model: torch.nn.Module) -> dict[str, list[str]]:
    """Parameters other modules share (tied embeddings): each one's name as
    ``model.named_parameters()`` gives it -> the other names of the same tensor.
    """
    names: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        names[id(p)].append(name)
    return {n[0]: n[1:] for n in names.values() if len(n) > 1}


def check_untied(model: torch.nn.Module, params: Collection[str]) -> None:
    """Refuse dynamic updates of a tensor several modules share: a dynamic update runs in one
    module's forward, so the others would read the weight without it, unlike the merged model.

    Raises:
        UnsupportedLayerError: one of ``params`` is tied to another module's parameter.
    """
    shared = tied_parameters(model)
    tied = sorted(p for p in params if p in shared)
    if tied:
        raise UnsupportedLayerError(
            f"parameter {tied[0]!r} is tied to {shared[tied[0]]} (one tensor, several "
            "modules): a dynamic update would reach only one module's forward, and the model "
            "would not compute what the merged one does. Merge these adapters (mode='merge' or "
            "'auto', or shuttle.merge_lora), or untie the weights first; nothing was attached.")
