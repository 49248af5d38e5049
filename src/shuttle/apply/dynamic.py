"""Dynamic adapters: updates added at forward time, base weights untouched.

``attach_lora`` validates exactly as a merge does (nothing is attached when anything is wrong),
then installs one :class:`~shuttle.apply.dynamic_layer.LoRAHook` per adapted module. The returned
:class:`DynamicAdapters` changes strengths (in place: a compiled model does not recompile), swaps
an adapter for another of the same targets and rank, and detaches, leaving every module as it was.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict

import torch

from shuttle.apply.dynamic_layer import LoRAHook, Quality
from shuttle.apply.merge import MergeReport
from shuttle.apply.notes import plan_notes
from shuttle.apply.plan import AdapterList, Contribution, MergePlan, plan_merge
from shuttle.apply.scale import bump_generation
from shuttle.errors import InvalidStrengthError, ShuttleError
from shuttle.formats import LoRA, load_lora
from shuttle.hooks import add_hook, remove_hook
from shuttle.patches import LowRank
from shuttle.targets import KeyMapping, resolve

__all__ = ["QUALITIES", "DynamicAdapters", "attach_lora", "attach_plan", "default_quality"]

QUALITIES: tuple[str, ...] = ("exact", "lossless", "fused")


def default_quality(model: torch.nn.Module) -> Quality:
    """The tier used when none is given: ``"lossless"``.

    ``"fused"`` becomes the default on CUDA only where it measures faster; its first H200
    measurements (docs/dynamic.md) did not yet beat lossless, so it is opt-in.
    """
    return "lossless"


class DynamicAdapters:
    """Adapters attached to a model for forward-time application.

    Attributes:
        report: what was placed (``applied`` parameter names) and what was not.
        quality: the tier of low-rank Linear updates.
    """

    def __init__(self, model: torch.nn.Module, loras: list[LoRA], strengths: list[float],
                 quality: Quality, report: MergeReport):
        self.model = model
        self.loras = loras
        self.strengths = strengths
        self.quality = quality
        self.report = report
        self.hooks: dict[str, LoRAHook] = {}
        self._strength_t: dict[torch.device, torch.Tensor] = {}

    @property
    def applied(self) -> list[str]:
        """Parameter names with a dynamic update."""
        return self.report.applied

    @property
    def unmatched(self) -> dict[str, str]:
        """Adapter keys that reached no parameter, with why."""
        return self.report.unmatched

    def strength_tensor(self, device: torch.device) -> torch.Tensor:
        """``(n_adapters,)`` float32 strengths on ``device`` (updated in place)."""
        t = self._strength_t.get(device)
        if t is None:
            t = self._strength_t[device] = torch.tensor(self.strengths, dtype=torch.float32,
                                                        device=device)
        return t

    def set_strength(self, index: int, strength: float) -> None:
        """Change adapter ``index``'s strength without rebuilding low-rank factors.

        Raises:
            InvalidStrengthError: ``strength`` is not a finite number.
        """
        if not isinstance(strength, numbers.Real) or not math.isfinite(float(strength)):
            raise InvalidStrengthError(f"strength {strength!r} must be a finite real number")
        self.strengths[index] = float(strength)
        for t in self._strength_t.values():
            t[index] = float(strength)
        bump_generation()
        modules = dict(self.model.named_modules())
        for name, hook in self.hooks.items():
            if any(c.adapter == index for cs in hook.dense.values() for c in cs):
                hook.refresh(modules[name])

    def swap(self, index: int, lora: LoRA | str, mapping: KeyMapping | None = None) -> None:
        """Replace adapter ``index`` by ``lora``, which must reach the same Linear/Conv modules
        with low-rank patches of rank at most the attached one (see ``max_rank``).

        Factors are copied into the existing buffers, so a compiled model keeps its graphs.
        """
        new = load_lora(lora)
        res = resolve(new, self.model, mapping)
        by_module: dict[str, LowRank] = {}
        for t in res.targets:
            module = t.param.rpartition(".")[0]
            if not isinstance(t.patch, LowRank) or t.param.rpartition(".")[2] != "weight":
                raise ShuttleError(f"swap supports low-rank weight patches only; {t.module_key!r}"
                                   f" is {t.patch.kind} on {t.param!r}")
            by_module[module] = t.patch
        old = {n for n, h in self.hooks.items() if any(s.adapter == index for s in h.slots)}
        if set(by_module) != old:
            raise ShuttleError(
                f"swap needs the same target modules: the new adapter reaches "
                f"{len(by_module)} modules, the attached one {len(old)} "
                f"(differing: {sorted(set(by_module) ^ old)[:4]}); detach and attach instead"
            )
        modules = dict(self.model.named_modules())
        for name, patch in by_module.items():
            self.hooks[name].swap(index, patch.load(modules[name].weight.device))
        self.loras[index] = new
        bump_generation()

    def detach(self) -> None:
        """Remove every hook; the model is exactly as before attaching."""
        modules = dict(self.model.named_modules())
        for name, hook in self.hooks.items():
            remove_hook(modules[name], hook)
        self.hooks.clear()


def attach_lora(
    model: torch.nn.Module,
    loras: AdapterList,
    *,
    quality: Quality | None = None,
    mapping: KeyMapping | None = None,
    max_rank: int | None = None,
) -> DynamicAdapters:
    """Attach adapters for forward-time application; returns a handle (call ``detach()``).

    Args:
        model: the model; its weights are never written.
        loras: ``[(lora, strength), ...]``; zero strengths are dropped.
        quality: ``"exact"``, ``"lossless"`` or ``"fused"`` (default: :func:`default_quality`).
        mapping: as for :func:`~shuttle.merge_lora`.
        max_rank: pad low-rank Linear slots to this rank so :meth:`DynamicAdapters.swap` can
            bring in adapters up to it without recompiling.

    Raises:
        Everything :func:`~shuttle.merge_lora` raises, before anything is attached;
        UnsupportedLayerError: a patch a layer cannot take dynamically.
    """
    quality = quality or default_quality(model)
    if quality not in QUALITIES:
        raise ShuttleError(f"quality={quality!r}: expected one of {', '.join(QUALITIES)}")
    return attach_plan(model, plan_merge(model, loras, mapping), quality, max_rank)


def attach_plan(model: torch.nn.Module, plan: MergePlan, quality: Quality,
                max_rank: int | None = None) -> DynamicAdapters:
    """Attach a validated (and loaded) plan: :func:`attach_lora` after planning.

    ``plan.params`` may be a subset of a plan's parameters (``mode="auto"`` attaches the ones
    it does not merge); only those get hooks.

    Raises:
        UnsupportedLayerError: a patch a layer cannot take dynamically; nothing is attached.
    """
    per_module: dict[str, dict[str, list[Contribution]]] = defaultdict(lambda: defaultdict(list))
    for param, contribs in plan.params.items():
        module, _, leaf = param.rpartition(".")
        per_module[module][leaf].extend(contribs)
    report = MergeReport(list(plan.params), plan.unmatched, plan.skipped, plan_notes(plan))
    handle = DynamicAdapters(model, [lora for lora, _ in plan.adapters],
                             [s for _, s in plan.adapters], quality, report)
    modules = dict(model.named_modules())
    hooks = {name: LoRAHook(name, modules[name], dict(leaves), handle.strengths,
                            handle.strength_tensor, quality, max_rank)
             for name, leaves in per_module.items()}  # built first: a failure attaches nothing
    try:
        for name, hook in hooks.items():
            add_hook(modules[name], hook)
            handle.hooks[name] = hook
    except BaseException:
        handle.detach()  # roll back the hooks already installed
        raise
    return handle
