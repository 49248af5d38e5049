"""Swap PEFT's LoRA forward for the hand-derived functions, in place, and back.

:func:`accelerate` installs :mod:`shuttle.hooks` hooks (the module classes and parameters are
untouched; :func:`restore` deletes them and the model is exactly what it was):

- on every PEFT LoRA ``Linear`` (``peft.tuners.lora.layer.Linear``) that qualifies:
  :func:`~shuttle.train.lora_linear.lora_linear` (dropout included);
- on a gated MLP of a known class (Llama, Mistral, Qwen, Gemma, ...: ``down(act(gate(x)) *
  up(x))``) whose three projections are LoRA or frozen ``Linear`` layers and whose activation
  is SiLU or GELU (checked numerically): :func:`~shuttle.train.lora_mlp.lora_mlp`;
- on sibling projections of one input (``q_proj``/``k_proj``/``v_proj``, ``to_q``/``to_k``/
  ``to_v``, ...) where the calling code (the module's forward, or a diffusers attention
  processor) passes them one variable: :func:`~shuttle.train.lora_qkv.lora_projections` (the
  first caller computes all three and hands the others theirs).

Each hook checks on every call what could change since (the active adapter, merged or
disabled adapters, dropout in training, autocast, the input's dtype and device) and otherwise
runs PEFT's own forward: a module never computes something PEFT would not. What qualifies is
decided per module and reported (:class:`AccelerateReport`); the rest keeps PEFT's path.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from shuttle.errors import (
    MergedWeightError,
    ShuttleError,
    UnsupportedBaseError,
    UnsupportedModelError,
)
from shuttle.hooks import ModuleHook, add_hook, hooks_of, remove_hook
from shuttle.kernels.gated import ACTIVATIONS, gated_forward_reference
from shuttle.train.frozen import FrozenLinear, frozen_linear
from shuttle.train.lora_linear import lora_linear
from shuttle.train.lora_mlp import lora_mlp
from shuttle.train.lora_qkv import lora_projections
from shuttle.weights.upcast import UpcastHook

__all__ = ["GATED_MLPS", "PROJECTION_GROUPS", "AccelerateReport", "accelerate", "restore"]

log = logging.getLogger("shuttle")

# Gated MLP classes whose forward is down(act(gate(x)) * up(x)) -> (gate, up, down, act) names.
GATED_MLPS: dict[str, tuple[str, str, str, str]] = {
    name: ("gate_proj", "up_proj", "down_proj", "act_fn") for name in (
        "LlamaMLP", "MistralMLP", "MixtralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen2MoeMLP",
        "Qwen3MoeMLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP", "OlmoMLP", "Olmo2MLP",
        "GraniteMLP", "CohereMLP", "Ministral3MLP", "SmolLM3MLP", "HunYuanDenseV1MLP",
    )
}

# Sibling projections that attention modules call on one input.
PROJECTION_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"), ("to_q", "to_k", "to_v"),
    ("add_q_proj", "add_k_proj", "add_v_proj"), ("query", "key", "value"),
)


@dataclasses.dataclass
class AccelerateReport:
    """What :func:`accelerate` patched, and why the rest was left alone.

    Attributes:
        patched: module name -> the path it now takes (``"lora_linear"``, ``"mlp"``,
            ``"projections"``).
        skipped: module name -> why it keeps PEFT's (or its own) forward.
    """

    patched: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        """One line per path, and the reasons modules were skipped."""
        counts: dict[str, int] = {}
        for path in self.patched.values():
            counts[path] = counts.get(path, 0) + 1
        lines = [f"shuttle.train.accelerate: patched {len(self.patched)} module(s) ("
                 + ", ".join(f"{n} {p}" for p, n in sorted(counts.items())) + ")"]
        reasons: dict[str, list[str]] = {}
        for name, why in self.skipped.items():
            reasons.setdefault(why, []).append(name)
        for why, names in reasons.items():
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            lines.append(f"  skipped {len(names)}: {why} ({', '.join(names[:3])}{more})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# -- PEFT's LoRA layer, read without importing peft ------------------------------------------

def _is_peft_lora(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("base_layer", "lora_A", "lora_B", "scaling",
                                              "lora_dropout", "active_adapters"))


def _static_reason(module: torch.nn.Module) -> str | None:
    """Why a PEFT LoRA layer can never take the fast path (None: it can, by its build)."""
    base = module.base_layer
    if not isinstance(base, torch.nn.Linear):
        return f"a {type(base).__name__} base layer (the fast path takes Linear layers)"
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out weights"
    if base._forward_hooks or base._forward_pre_hooks or hasattr(base, "_hf_hook") \
            or any(not isinstance(h, UpcastHook) for h in hooks_of(base)):
        return "the base layer has forward hooks (offloading per layer?)"
    try:
        frozen_linear(base)
    except UnsupportedBaseError as e:
        return str(e)
    return None


def _adapter_reason(module: torch.nn.Module, name: str) -> str | None:
    """Why adapter ``name`` of a PEFT LoRA layer cannot take the fast path."""
    if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name):
        return "a LoRA variant (DoRA, ...)"
    a, b = module.lora_A[name], module.lora_B[name]
    if not (isinstance(a, torch.nn.Linear) and isinstance(b, torch.nn.Linear)):
        return "LoRA factors that are not Linear layers"
    if b.bias is not None or a.bias is not None:
        return "a LoRA bias"
    drop = module.lora_dropout[name]
    if not isinstance(drop, (torch.nn.Dropout, torch.nn.Identity)):
        return f"a {type(drop).__name__} dropout"
    return None


class _Live(NamedTuple):
    """One LoRA layer as a call sees it (a tuple: made on every call of every layer)."""

    base: FrozenLinear
    a: torch.Tensor | None
    b: torch.Tensor | None
    scale: float
    dropout: float


def _live(module: torch.nn.Module, x: Any, memo: _LinearHook | None = None) -> _Live | None:
    """The layer's state for this call when the fast path computes what PEFT would, else None.
    A plain frozen ``nn.Linear`` (a projection without an adapter) reads as one without factors.

    ``memo``: the layer's hook, which knows whether the layer is a PEFT LoRA layer (decided when
    it was installed) and keeps the adapter (name and factor modules, held) last found fit by
    :func:`_adapter_reason`, so that a call checks the adapter's build only when it changed.
    The submodules are read from ``_modules`` (what ``nn.Module.__getattr__`` falls back to,
    without the failed attribute lookup before it): this runs for every layer at every call.
    """
    if not isinstance(x, torch.Tensor) or torch.is_autocast_enabled():
        return None
    if not (memo.lora if memo is not None else _is_peft_lora(module)):
        if not isinstance(module, torch.nn.Linear) or module._forward_hooks \
                or module._forward_pre_hooks \
                or any(not isinstance(h, _TrainHook) for h in hooks_of(module)):
            return None
        try:
            base = frozen_linear(module)
        except UnsupportedBaseError:
            return None
        return _Live(base, None, None, 0.0, 0.0) if base.takes(x) else None
    if module.disable_adapters or module.merged:
        return None
    mods = module._modules
    lora_a = mods["lora_A"]
    active = [n for n in module.active_adapters if n in lora_a._modules]
    if len(active) != 1:
        return None
    name = active[0]
    a, b, drop = lora_a._modules[name], mods["lora_B"]._modules[name], \
        mods["lora_dropout"]._modules[name]
    fit = (name, a, b, drop)  # the modules themselves: an id could be reused by a new one
    if memo is None or memo.fit != fit:
        if _adapter_reason(module, name) is not None:
            return None
        if memo is not None:
            memo.fit = fit
    try:
        base = frozen_linear(mods["base_layer"])
    except UnsupportedBaseError:
        return None
    if not base.takes(x):
        return None
    p = drop.p if drop.training and isinstance(drop, torch.nn.Dropout) else 0.0
    return _Live(base, a.weight, b.weight, float(module.scaling[name]), float(p))


# -- hooks ---------------------------------------------------------------------------------

class _TrainHook(ModuleHook):
    """Marks shuttle.train's hooks (what :func:`restore` removes)."""


class _LinearHook(_TrainHook):
    def __init__(self, lora: bool) -> None:
        self.lora = lora  # a PEFT LoRA layer (else a frozen Linear beside LoRA siblings)
        self.group: _Group | None = None
        self.fit: tuple | None = None  # see _live

    def forward(self, module: torch.nn.Module, inner: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs:
            return inner(*args, **kwargs)
        x = args[0]
        group = self.group
        if group is not None:
            out = group.claim(module, x)
            if out is not None:
                return out
        live = _live(module, x, self)
        if live is None:
            return inner(x)
        if group is not None and live.dropout == 0:
            out = group.output(module, x, live)
            if out is not None:
                return out
        if live.a is None:
            return inner(x)
        return lora_linear(x, live.base, live.a, live.b, live.scale, live.dropout)


class _Group:
    """Sibling projections of one input: the first called computes all of them (one read of
    the input for the adapters' shrinks, one saved copy) and hands the others their outputs.

    Made only where the calling code passes one variable to every member (:func:`_one_input`),
    so a forward and its recomputation under activation checkpointing take the same path. It
    turns itself off for good when a computed output goes unclaimed (the members saw different
    tensors after all). Under ``torch.compile`` Dynamo traces the stash and the identity check
    as it traces any Python state: the group runs inside the graph.
    """

    def __init__(self, name: str, members: list[torch.nn.Module]):
        self.name = name
        self.members = members
        self.hooks: list[_LinearHook] = []  # the members' hooks, in their order
        self.on = True
        self._stash: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None

    def claim(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The output computed for ``module`` by the member called first, if any is waiting."""
        stash = self._stash
        if stash is None:
            return None
        i = self._position(module)
        if stash[0] is x and i in stash[1]:
            out = stash[1].pop(i)
            if not stash[1]:
                self._stash = None
            return out
        log.info("shuttle.train: %s: projections see different inputs; computing them "
                 "one by one from now on", self.name)
        self.on, self._stash = False, None
        return None

    def output(self, module: torch.nn.Module, x: torch.Tensor, live: _Live
               ) -> torch.Tensor | None:
        """Every member's output for ``x`` (``live``: ``module``'s state); ``module``'s is
        returned, the others' kept for their calls. None where the group cannot run.
        """
        if not self.on:
            return None
        i = self._position(module)
        lives = [live if j == i else _live(m, x, h)
                 for j, (m, h) in enumerate(zip(self.members, self.hooks, strict=True))]
        if any(lv is None or lv.dropout for lv in lives):
            return None
        outs = lora_projections(x, *[(lv.base, lv.a, lv.b, lv.scale) for lv in lives])
        self._stash = (x, {j: o for j, o in enumerate(outs) if j != i})
        return outs[i]

    def clear(self) -> None:
        self._stash = None

    def _position(self, module: torch.nn.Module) -> int:
        return next(j for j, m in enumerate(self.members) if m is module)


def _linear_hook(module: torch.nn.Module) -> _LinearHook | None:
    """The :class:`_LinearHook` installed on ``module``, if any: read from the module itself,
    so a projection replaced after :func:`accelerate` is never taken for the one it replaced.
    """
    return next((h for h in hooks_of(module) if isinstance(h, _LinearHook)), None)


class _MLPHook(_TrainHook):
    def __init__(self, names: tuple[str, str, str, str], act: str):
        self.names = names
        self.act = act

    def forward(self, module: torch.nn.Module, inner: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs:
            return inner(*args, **kwargs)
        x = args[0]
        lives = []
        for n in self.names[:3]:  # down's input has x's dtype and device
            m = getattr(module, n)
            lv = _live(m, x, _linear_hook(m))
            if lv is None or lv.dropout:
                return inner(*args, **kwargs)
            lives.append(lv)
        return lora_mlp(x, self.act, *[(lv.base, lv.a, lv.b, lv.scale) for lv in lives])


def _one_input(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    """Whether the code calling ``module``'s projections ``names`` (its forward, or its
    attention processor's ``__call__``) passes every one of them the same variable, as in
    ``self.q_proj(hidden_states)``, ``self.k_proj(hidden_states)``, ...
    """
    sources = [type(module).forward]
    processor = getattr(module, "processor", None)
    if processor is not None:
        sources.append(type(processor).__call__)
    for fn in sources:
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        args = set()
        for name in names:
            found = re.findall(rf"(?:self|attn)\.{name}\(\s*([A-Za-z_]\w*)\s*\)", src)
            if not found:
                break
            args.update(found)
        else:
            if len(args) == 1:
                return True
    return False


def _activation(act: torch.nn.Module) -> str | None:
    """Which of :data:`~shuttle.kernels.gated.ACTIVATIONS` ``act`` computes, measured on a probe
    in float64 (a class name does not say which GELU it is), or None.
    """
    probe = torch.linspace(-6, 6, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = act(probe)
    except Exception:  # noqa: BLE001 - any failure means "not one we know"
        return None
    for name in ACTIVATIONS:
        want = gated_forward_reference(probe, torch.ones_like(probe), name)  # type: ignore[arg-type]
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-9, atol=1e-12):
            return name
    return None


# -- accelerate / restore --------------------------------------------------------------------

def _check_model(model: object, where: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(
            f"{where}(model): model is a {type(model).__name__}, not an nn.Module; pass the "
            "PEFT LoRA model (peft.get_peft_model(...)) or any nn.Module holding PEFT LoRA "
            "layers (a diffusers pipeline's denoiser: pipe.transformer or pipe.unet)")


def _check_not_merged(model: torch.nn.Module) -> None:
    from shuttle.apply.scoped import merged_parameters

    params = dict(model.named_parameters())
    trainable = [n for n in merged_parameters(model) if n in params and params[n].requires_grad]
    if trainable:
        raise MergedWeightError(
            f"{trainable[:3]} are trainable and currently merged with an adapter "
            "(apply_lora(mode='merge')): their gradients would be taken against the merged "
            "weights. Leave the apply_lora block, or use mode='dynamic', before training.")


def accelerate(model: torch.nn.Module, *, mlp: bool = True, projections: bool = True,
               verbose: bool = False) -> AccelerateReport:
    """Patch ``model``'s PEFT LoRA layers (and the gated MLPs and q/k/v groups made of them)
    with shuttle's hand-derived training functions, in place.

    Args:
        model: a PEFT LoRA model (``get_peft_model``) or any model holding PEFT LoRA layers.
        mlp: fuse known gated MLPs into one function.
        projections: fuse sibling q/k/v projections of one input.
        verbose: log the summary at INFO (it is always returned).

    Returns:
        What was patched and why the rest was not.

    Raises:
        UnsupportedModelError: ``model`` is not an ``nn.Module``.
        MergedWeightError: a trainable weight is merged with an adapter right now.
        ShuttleError: the model is accelerated already (call :func:`restore` first).
    """
    _check_model(model, "accelerate")
    if any(isinstance(h, _TrainHook) for m in model.modules() for h in hooks_of(m)):
        raise ShuttleError("the model is accelerated already; shuttle.train.restore(model) "
                           "first")
    _check_not_merged(model)
    report = AccelerateReport()
    installed: list[tuple[torch.nn.Module, ModuleHook]] = []
    linear_hooks: dict[int, _LinearHook] = {}
    names = {id(m): n for n, m in model.named_modules()}
    try:
        for name, module in model.named_modules():
            if not _is_peft_lora(module):
                continue
            why = _static_reason(module)
            if why is None:
                adapters = [a for a in module.active_adapters if a in module.lora_A]
                if len(adapters) != 1:
                    why = f"{len(adapters)} active adapters"
                else:
                    why = _adapter_reason(module, adapters[0])
            if why is not None:
                report.skipped[name] = why
                continue
            hook = _LinearHook(lora=True)
            add_hook(module, hook)
            installed.append((module, hook))
            linear_hooks[id(module)] = hook
            report.patched[name] = "lora_linear"
        for name, module in model.named_modules():
            if projections:
                for group in PROJECTION_GROUPS:
                    # its own children only: getattr would also find a wrapped model's
                    # projections through a wrapper's attribute forwarding (PeftModel's)
                    members = [module._modules.get(g) for g in group]
                    hooked = [m for m in members if m is not None and id(m) in linear_hooks]
                    if len(hooked) < 2 or any(m is None for m in members):
                        continue
                    if any(id(m) not in linear_hooks and not isinstance(m, torch.nn.Linear)
                           for m in members):
                        continue
                    if not _one_input(module, group):
                        report.skipped[f"{name}.{{{','.join(group)}}}"] = (
                            "projections not called on one variable (each keeps its own "
                            "fast path)")
                        continue
                    shared = _Group(f"{name}.{{{','.join(group)}}}", members)
                    for m in members:
                        if id(m) not in linear_hooks:  # a frozen Linear beside the LoRA ones
                            hook = _LinearHook(lora=False)
                            add_hook(m, hook)
                            installed.append((m, hook))
                            linear_hooks[id(m)] = hook
                        linear_hooks[id(m)].group = shared
                        shared.hooks.append(linear_hooks[id(m)])
                        report.patched[names[id(m)]] = "projections"
            form = GATED_MLPS.get(type(module).__name__) if mlp else None
            if form is None:
                continue
            # the projections among its own children (as for the q/k/v groups); the activation
            # may be a plain function attribute rather than a module
            parts = [*(module._modules.get(n) for n in form[:3]), getattr(module, form[3], None)]
            if any(p is None for p in parts):
                continue
            if not any(id(p) in linear_hooks for p in parts[:3]):
                continue
            act = _activation(parts[3])
            if act is None:
                report.skipped[name] = f"an activation {type(parts[3]).__name__} the fused MLP " \
                    "does not know (each projection keeps its own fast path)"
                continue
            if not all(id(p) in linear_hooks or isinstance(p, torch.nn.Linear)
                       for p in parts[:3]):
                report.skipped[name] = "a projection that is neither LoRA nor Linear"
                continue
            hook = _MLPHook(form, act)
            add_hook(module, hook)
            installed.append((module, hook))
            report.patched[name] = "mlp"
    except BaseException:
        for module, hook in reversed(installed):
            remove_hook(module, hook)
        raise
    if verbose:
        log.info("%s", report.summary())
    return report


def restore(model: torch.nn.Module) -> int:
    """Remove every hook :func:`accelerate` installed on ``model``; returns how many.

    Raises:
        UnsupportedModelError: ``model`` is not an ``nn.Module``.
    """
    _check_model(model, "restore")
    n = 0
    for module in model.modules():
        for hook in hooks_of(module):
            if isinstance(hook, _TrainHook):
                if isinstance(hook, _LinearHook) and hook.group is not None:
                    hook.group.clear()
                remove_hook(module, hook)
                n += 1
    return n
