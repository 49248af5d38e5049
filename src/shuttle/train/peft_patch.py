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

What qualifies is read in :mod:`~shuttle.train.peft_layers`, the hooks live in
:mod:`~shuttle.train.peft_hooks`; here are the verb's steps (LoRA layers, then per module its
projection groups and its gated MLP) and their undo.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from shuttle.errors import MergedWeightError, ShuttleError, UnsupportedModelError
from shuttle.hooks import ModuleHook, add_hook, hooks_of, remove_hook
from shuttle.train.peft_hooks import LinearHook, MLPHook, ProjectionGroup, TrainHook
from shuttle.train.peft_layers import (
    GATED_MLPS,
    PROJECTION_GROUPS,
    activation,
    adapter_reason,
    is_peft_lora,
    one_input,
    static_reason,
)

__all__ = ["AccelerateReport", "accelerate", "restore"]

log = logging.getLogger("shuttle")


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
    if any(isinstance(h, TrainHook) for m in model.modules() for h in hooks_of(m)):
        raise ShuttleError("the model is accelerated already; shuttle.train.restore(model) "
                           "first")
    _check_not_merged(model)
    patch = _Patch(model)
    try:
        patch.lora_layers()
        for name, module in model.named_modules():
            if projections:
                patch.projection_groups(name, module)
            if mlp:
                patch.gated_mlp(name, module)
    except BaseException:
        patch.undo()
        raise
    if verbose:
        log.info("%s", patch.report.summary())
    return patch.report


def restore(model: torch.nn.Module) -> int:
    """Remove every hook :func:`accelerate` installed on ``model``; returns how many.

    Raises:
        UnsupportedModelError: ``model`` is not an ``nn.Module``.
    """
    _check_model(model, "restore")
    n = 0
    for module in model.modules():
        for hook in hooks_of(module):
            if isinstance(hook, TrainHook):
                if isinstance(hook, LinearHook) and hook.group is not None:
                    hook.group.clear()
                remove_hook(module, hook)
                n += 1
    return n


def _check_model(model: object, where: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(
            f"{where}(model): model is a {type(model).__name__}, not an nn.Module; pass the "
            "PEFT LoRA model (peft.get_peft_model(...)) or any nn.Module holding PEFT LoRA "
            "layers (a diffusers pipeline's denoiser: pipe.transformer or pipe.unet)")


def _check_not_merged(model: torch.nn.Module) -> None:
    from shuttle.apply.open_scopes import merged_parameters

    params = dict(model.named_parameters())
    trainable = [n for n in merged_parameters(model) if n in params and params[n].requires_grad]
    if trainable:
        raise MergedWeightError(
            f"{trainable[:3]} are trainable and currently merged with an adapter "
            "(apply_lora(mode='merge')): their gradients would be taken against the merged "
            "weights. Leave the apply_lora block, or use mode='dynamic', before training.")


class _Patch:
    """One :func:`accelerate` call's steps over ``model``: the hooks it installed (undone in
    reverse by :meth:`undo` when a later step fails) and the report it builds.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.report = AccelerateReport()
        self.installed: list[tuple[torch.nn.Module, ModuleHook]] = []
        self.linear_hooks: dict[int, LinearHook] = {}  # id(module) -> its hook
        self.names = {id(m): n for n, m in model.named_modules()}

    def _add(self, module: torch.nn.Module, hook: ModuleHook) -> None:
        add_hook(module, hook)
        self.installed.append((module, hook))
        if isinstance(hook, LinearHook):
            self.linear_hooks[id(module)] = hook

    def undo(self) -> None:
        """Remove every hook this call installed, last first."""
        for module, hook in reversed(self.installed):
            remove_hook(module, hook)

    def lora_layers(self) -> None:
        """Step 1: a :class:`LinearHook` on every PEFT LoRA layer whose build and single active
        adapter qualify; the others are reported skipped with why.
        """
        for name, module in self.model.named_modules():
            if not is_peft_lora(module):
                continue
            why = static_reason(module)
            if why is None:
                adapters = [a for a in module.active_adapters if a in module.lora_A]
                if len(adapters) != 1:
                    why = f"{len(adapters)} active adapters"
                else:
                    why = adapter_reason(module, adapters[0])
            if why is not None:
                self.report.skipped[name] = why
                continue
            self._add(module, LinearHook(lora=True))
            self.report.patched[name] = "lora_linear"

    def projection_groups(self, name: str, module: torch.nn.Module) -> None:
        """Step 2: ``module``'s sibling projections of one input (at least two hooked in step 1,
        the rest frozen ``Linear`` layers) share one :class:`ProjectionGroup`.
        """
        for group in PROJECTION_GROUPS:
            # its own children only: getattr would also find a wrapped model's projections
            # through a wrapper's attribute forwarding (PeftModel's)
            members = [module._modules.get(g) for g in group]
            if any(m is None for m in members):
                continue
            hooked = [m for m in members if id(m) in self.linear_hooks]
            if len(hooked) < 2:
                continue
            if any(id(m) not in self.linear_hooks and not isinstance(m, torch.nn.Linear)
                   for m in members):
                continue
            label = f"{name}.{{{','.join(group)}}}"
            if not one_input(module, group):
                self.report.skipped[label] = ("projections not called on one variable (each "
                                              "keeps its own fast path)")
                continue
            shared = ProjectionGroup(label, members)  # type: ignore[arg-type]
            for m in members:
                if id(m) not in self.linear_hooks:  # a frozen Linear beside the LoRA ones
                    self._add(m, LinearHook(lora=False))
                hook = self.linear_hooks[id(m)]
                hook.group = shared
                shared.hooks.append(hook)
                self.report.patched[self.names[id(m)]] = "projections"

    def gated_mlp(self, name: str, module: torch.nn.Module) -> None:
        """Step 3: a known gated MLP whose projections were hooked (or are frozen ``Linear``
        layers) and whose activation is one the fused function knows gets an :class:`MLPHook`.
        """
        form = GATED_MLPS.get(type(module).__name__)
        if form is None:
            return
        # the projections among its own children (as for the q/k/v groups); the activation may
        # be a plain function attribute rather than a module
        parts = [*(module._modules.get(n) for n in form[:3]), getattr(module, form[3], None)]
        if any(p is None for p in parts):
            return
        if not any(id(p) in self.linear_hooks for p in parts[:3]):
            return
        act = activation(parts[3])
        if act is None:
            self.report.skipped[name] = (f"an activation {type(parts[3]).__name__} the fused MLP "
                                         "does not know (each projection keeps its own fast path)")
            return
        if not all(id(p) in self.linear_hooks or isinstance(p, torch.nn.Linear)
                   for p in parts[:3]):
            self.report.skipped[name] = "a projection that is neither LoRA nor Linear"
            return
        self._add(module, MLPHook(form, act))
        self.report.patched[name] = "mlp"
