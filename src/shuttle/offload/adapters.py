"""Adapters applied for the length of one activation: merged as weights land, or dynamic.

:class:`ActivationAdapters` is built before the offloader takes any device memory for weights:
every adapter is resolved and validated against the model's (host) parameters by
:func:`~shuttle.apply.plan.plan_params`, and only then are the patch tensors read onto the
device, once; they stay there for the activation (they are small), so nothing is rebuilt per
step.

* ``mode="merge"``: :meth:`fold` is called by each :class:`~shuttle.offload.slots.SlotPool`
  right after a unit's bytes land in a slot (on CUDA on the copy stream, before the slot's
  ``loaded`` event, so compute that waits on the event sees merged weights). It runs
  :func:`~shuttle.apply.param_merge.merge_param` on the slot's views: float32 sum, one rounding,
  exactly what :func:`~shuttle.merge_lora` does to a resident copy. The host copy is never
  written, so every load (a block streamed again next step) starts from pristine weights and
  is merged exactly once.
* ``mode="auto"``: per parameter, merged where a merge in its dtype keeps the update and
  dynamic where it does not (:func:`~shuttle.apply.auto.decide`, measured once per activation
  with each weight copied to the device in turn); ``decisions`` says which.
* ``mode="dynamic"``: one :class:`~shuttle.apply.dynamic_layer.LoRAHook` per adapted module
  (the machinery of :func:`~shuttle.attach_lora`), built against device copies of the module's
  own parameters so its factors and residuals live on the device; attached after the streaming
  hooks (so on a module with both, the stream hook is outermost and binds the weights first)
  and removed at deactivate.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch

from shuttle.apply.auto import DEFAULT_THRESHOLD, Decision, decide
from shuttle.apply.dynamic import (
    QUALITIES,
    DynamicAdapters,
    check_untied,
    default_quality,
    tied_parameters,
)
from shuttle.apply.dynamic_layer import LoRAHook, Quality
from shuttle.apply.memo import memo_of
from shuttle.apply.merge import MergeReport
from shuttle.apply.notes import plan_notes
from shuttle.apply.param_merge import exact_cublas, merge_param
from shuttle.apply.plan import AdapterList, Contribution, Mode, plan_params
from shuttle.apply.rounding import merge_seeds
from shuttle.errors import OffloadError, UnsupportedLayerError
from shuttle.hooks import add_hook, substituted
from shuttle.offload.host_storage import HostStorage
from shuttle.offload.host_unit import HostUnit
from shuttle.targets import KeyMapping, fused_modules, transposed_modules
from shuttle.weights.plain import is_plain_tensor

__all__ = ["ActivationAdapters", "check_quality", "former_mode"]



class _Target(NamedTuple):
    entry: int  # index into the unit's layout
    name: str  # the parameter's name in the model
    contribs: list[Contribution]
    seed: int  # merge_seed(name, None, contribs): a float8 or quantized weight's rounding


def former_mode(mode: Mode, lora_mode: Mode | None) -> Mode:
    """``mode``, or what the former keyword ``lora_mode=`` gave (with a :class:`FutureWarning`:
    the adapter mode is ``mode=`` everywhere, as in ``apply_lora`` and ``set_loras``).

    Raises:
        OffloadError: both given, and different.
    """
    if lora_mode is None:
        return mode
    warnings.warn("lora_mode= is now mode= (the name apply_lora and set_loras use); the old "
                  "spelling will be removed", FutureWarning, stacklevel=3)
    if mode not in ("merge", lora_mode):
        raise OffloadError(f"mode={mode!r} and lora_mode={lora_mode!r}: give mode= only")
    return lora_mode


def check_quality(quality: Quality | None) -> None:
    """Raise :class:`OffloadError` for an unknown ``quality`` (None: the default)."""
    if quality is not None and quality not in QUALITIES:
        raise OffloadError(f"quality={quality!r}: expected one of {', '.join(QUALITIES)}")


class ActivationAdapters:
    """Validated adapters for one activation of a model held in ``storage``.

    Args:
        model: the offloaded model, inactive (its tensors on host storage).
        storage: its host storage.
        loras: ``[(lora, strength), ...]`` with at least one non-zero strength.
        mode: ``"merge"``, ``"dynamic"`` or ``"auto"``.
        device: the activation's device; the patch tensors are read onto it.
        quality: the dynamic tier (default: :func:`~shuttle.apply.dynamic.default_quality`).
        mapping: adapter module key -> model module path, as for :func:`~shuttle.merge_lora`.
        auto_threshold: with ``"auto"``, the largest fraction of a parameter's update a merge
            may round away (see :func:`~shuttle.apply.auto.decide`).

    Attributes:
        mode: the mode.
        decisions: with ``"auto"``, parameter name -> :class:`~shuttle.apply.auto.Decision`.
        report: parameters adapted (``applied``), adapter keys left over (``unmatched``,
            ``skipped``).
        folds: merges done so far (one per adapted parameter per unit load; merge mode).

    Raises:
        Everything :func:`~shuttle.merge_lora` raises (before any patch is read), and
        UnsupportedLayerError: a patch a layer cannot take dynamically (dynamic mode).
    """

    def __init__(self, model: torch.nn.Module, storage: HostStorage, loras: AdapterList,
                 mode: Mode, device: torch.device, quality: Quality | None = None,
                 mapping: KeyMapping | None = None, auto_threshold: float = DEFAULT_THRESHOLD):
        self.model = model
        self.mode = mode
        # Validates every target over the host tensors' specs first, then reads the patches
        # onto the device and checks them finite.
        params = dict(model.named_parameters())
        plan = plan_params(params, loras, mapping, device=device, fused=fused_modules(model),
                           transposed=transposed_modules(model), memo=memo_of(model))
        quantized = [n for n in plan.params if not is_plain_tensor(params[n])]
        if quantized and mode != "dynamic":
            # The slots hold such a weight's storage tensors (packed data, scales): a merge as
            # they land would have to re-encode them on every load.
            raise UnsupportedLayerError(
                f"{len(quantized)} adapted parameter(s) are quantized ({quantized[0]!r} ...): "
                f"mode={mode!r} during an offloader activation cannot merge into them. "
                'Use mode="dynamic" (the layer\'s own quantized forward plus the update), '
                "or merge the adapter before capturing the model (shuttle.merge_lora)."
            )
        self.plan = plan
        self.report = MergeReport(list(plan.params), plan.unmatched, plan.skipped,
                                  plan_notes(plan))
        self.folds = 0
        self.decisions: dict[str, Decision] = {}
        merged, dynamic = (plan.params, {}) if mode == "merge" else ({}, plan.params)
        if mode == "dynamic":
            check_untied(model, plan.params)
        if mode == "auto":
            params = dict(model.named_parameters())
            self.decisions = decide(plan, _OnDevice(params, device), auto_threshold,
                                    tied=tied_parameters(model).keys())
            merged = {n: cs for n, cs in plan.params.items()
                      if self.decisions[n].mode == "merge"}
            dynamic = {n: cs for n, cs in plan.params.items() if n not in merged}
        self._targets = _targets_by_unit(model, storage, merged)
        self.handle: DynamicAdapters | None = None
        self._built: dict[str, LoRAHook] = {}
        if dynamic:
            self._build_hooks(device, quality or default_quality(model), dynamic)

    @property
    def merges(self) -> bool:
        """Whether some parameter is merged as its unit lands."""
        return bool(self._targets)

    @property
    def dynamic(self) -> bool:
        """Whether some module gets a dynamic hook (installed by :meth:`attach`)."""
        return bool(self._built)

    def touches(self, unit: HostUnit) -> bool:
        """Whether any adapted parameter lies in ``unit``."""
        return unit.name in self._targets

    def fold(self, unit: HostUnit, views: list[torch.Tensor]) -> None:
        """Merge the adapters into ``unit``'s tensors, ``views`` (just copied from the host)."""
        targets = self._targets.get(unit.name)
        if not targets:
            return
        with torch.no_grad(), exact_cublas():
            for t in targets:
                # Each fold lands in a fresh copy from the host with the same seed: the same
                # rounding bits every time, and no read of the adapter per fold.
                merge_param(views[t.entry], t.name, t.contribs, encoded_seed=t.seed)
                self.folds += 1

    def merged_copies(self, unit: HostUnit) -> list[torch.Tensor]:
        """``unit``'s host tensors with merged copies of the adapted ones (CPU pass-through)."""
        views = unit.host_tensors()
        for t in self._targets.get(unit.name, ()):
            views[t.entry] = views[t.entry].clone()
        self.fold(unit, views)
        return views

    def attach(self) -> None:
        """Install the dynamic hooks (dynamic mode; undone by :meth:`detach`)."""
        assert self.handle is not None, "attach() is for dynamic hooks"
        modules = dict(self.model.named_modules())
        for name, hook in self._built.items():
            add_hook(modules[name], hook)
            self.handle.hooks[name] = hook

    def detach(self) -> None:
        """Remove every dynamic hook installed (nothing to do in merge mode)."""
        if self.handle is not None:
            self.handle.detach()

    def _build_hooks(self, device: torch.device, quality: Quality,
                     params: dict[str, list[Contribution]]) -> None:
        per_module: dict[str, dict[str, list[Contribution]]] = defaultdict(
            lambda: defaultdict(list))
        for param, contribs in params.items():
            module, _, leaf = param.rpartition(".")
            per_module[module][leaf].extend(contribs)
        adapters = self.plan.adapters
        self.handle = DynamicAdapters(self.model, [lora for lora, _ in adapters],
                                      [s for _, s in adapters], quality, self.report)
        modules = dict(self.model.named_modules())
        for name, leaves in per_module.items():
            module = modules[name]
            args = (name, module, dict(leaves), self.handle.strengths, quality)
            if not all(is_plain_tensor(p) for p in module.parameters(recurse=False)):
                # A quantized layer: the hook reads only the weight's logical shape and dtype
                # (from its representation on the host) and takes low-rank patches only; its
                # factors then move to the device.
                hook = LoRAHook(*args)
                hook.to_device(device)
                self._built[name] = hook
                continue
            # The hook sizes its factors and computes its float32 residuals from the module's
            # weights: give it device copies (one module at a time, transient) so both land on
            # the device even for a block that streams.
            on_device = {k: p.detach().to(device)
                         for k, p in module.named_parameters(recurse=False)}
            with substituted(module, on_device):
                self._built[name] = LoRAHook(*args)


class _OnDevice(Mapping[str, torch.Tensor]):
    """Parameters read onto ``device`` one at a time, as :func:`decide` asks for them (the
    patches are on the device; a whole streamed model would not fit there).
    """

    def __init__(self, params: dict[str, torch.Tensor], device: torch.device):
        self._params, self._device = params, device

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._params[name].detach().to(self._device)

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def _targets_by_unit(model: torch.nn.Module, storage: HostStorage,
                     params: dict[str, list[Contribution]]) -> dict[str, list[_Target]]:
    """Unit name -> the adapted parameters in it, as layout entries."""
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[str, list[_Target]] = {}
    found: set[str] = set()
    for unit in storage.units:
        seen: set[int] = set()
        for b in unit.bindings:
            if not b.is_param:
                continue
            prefix = names[id(b.module)]
            full = f"{prefix}.{b.name}" if prefix else b.name
            if full in params and b.entry not in seen:  # a tied tensor is merged once
                seen.add(b.entry)
                found.add(full)
                out.setdefault(unit.name, []).append(_Target(b.entry, full, params[full], 0))
    missing = set(params) - found
    assert not missing, f"adapted parameters not found in host storage: {sorted(missing)[:4]}"
    targets = [t for ts in out.values() for t in ts]
    seeds = iter(merge_seeds([(t.name, t.contribs) for t in targets], None))
    return {unit: [t._replace(seed=next(seeds)) for t in ts] for unit, ts in out.items()}
