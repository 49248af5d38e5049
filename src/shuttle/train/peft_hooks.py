"""The hooks :func:`~shuttle.train.accelerate` installs, and what each reads on every call.

- :class:`LinearHook` on a PEFT LoRA ``Linear`` (or a frozen ``Linear`` beside LoRA siblings):
  :func:`~shuttle.train.lora_linear.lora_linear`, or its group's shared output;
- :class:`ProjectionGroup`: sibling projections of one input, the first called computes all of
  them with :func:`~shuttle.train.lora_qkv.lora_projections`;
- :class:`MLPHook` on a gated MLP: :func:`~shuttle.train.lora_mlp.lora_mlp`.

Each call first reads the layer's state (:func:`live`): the active adapter, merged or disabled
adapters, dropout in training, autocast, the input's dtype and device. Where the fast path would
not compute what PEFT computes, the hook runs PEFT's own forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from shuttle.errors import UnsupportedBaseError
from shuttle.hooks import ModuleHook, hooks_of
from shuttle.train.frozen import FrozenLinear, frozen_linear
from shuttle.train.lora_linear import lora_linear
from shuttle.train.lora_mlp import lora_mlp
from shuttle.train.lora_qkv import lora_projections
from shuttle.train.peft_layers import adapter_reason, is_peft_lora

__all__ = ["LinearHook", "Live", "MLPHook", "ProjectionGroup", "TrainHook", "linear_hook", "live"]

log = logging.getLogger("shuttle")


class Live(NamedTuple):
    """One LoRA layer as a call sees it (a tuple: made on every call of every layer)."""

    base: FrozenLinear
    a: torch.Tensor | None
    b: torch.Tensor | None
    scale: float
    dropout: float


def live(module: torch.nn.Module, x: Any, memo: LinearHook | None = None) -> Live | None:
    """The layer's state for this call when the fast path computes what PEFT would, else None.
    A plain frozen ``nn.Linear`` (a projection without an adapter) reads as one without factors.

    ``memo``: the layer's hook, which knows whether the layer is a PEFT LoRA layer (decided when
    it was installed) and keeps the adapter (name and factor modules, held) last found fit by
    :func:`~shuttle.train.peft_layers.adapter_reason`, so that a call checks the adapter's build
    only when it changed. The submodules are read from ``_modules`` (what
    ``nn.Module.__getattr__`` falls back to, without the failed attribute lookup before it):
    this runs for every layer at every call.
    """
    if not isinstance(x, torch.Tensor) or torch.is_autocast_enabled():
        return None
    if not (memo.lora if memo is not None else is_peft_lora(module)):
        if not isinstance(module, torch.nn.Linear) or module._forward_hooks \
                or module._forward_pre_hooks \
                or any(not isinstance(h, TrainHook) for h in hooks_of(module)):
            return None
        try:
            base = frozen_linear(module)
        except UnsupportedBaseError:
            return None
        return Live(base, None, None, 0.0, 0.0) if base.takes(x) else None
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
        if adapter_reason(module, name) is not None:
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
    return Live(base, a.weight, b.weight, float(module.scaling[name]), float(p))


class TrainHook(ModuleHook):
    """Marks shuttle.train's hooks (what :func:`~shuttle.train.restore` removes)."""


class LinearHook(TrainHook):
    """One projection's fast path: its group's output if one waits, else
    :func:`~shuttle.train.lora_linear.lora_linear`, else PEFT's forward.

    Args:
        lora: a PEFT LoRA layer (else a frozen ``Linear`` beside LoRA siblings).
    """

    def __init__(self, lora: bool) -> None:
        self.lora = lora
        self.group: ProjectionGroup | None = None
        self.fit: tuple | None = None  # see live()

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
        state = live(module, x, self)
        if state is None:
            return inner(x)
        if group is not None and state.dropout == 0:
            out = group.output(module, x, state)
            if out is not None:
                return out
        if state.a is None:
            return inner(x)
        return lora_linear(x, state.base, state.a, state.b, state.scale, state.dropout)


class ProjectionGroup:
    """Sibling projections of one input: the first called computes all of them (one read of
    the input for the adapters' shrinks, one saved copy) and hands the others their outputs.

    Made only where the calling code passes one variable to every member
    (:func:`~shuttle.train.peft_layers.one_input`), so a forward and its recomputation under
    activation checkpointing take the same path. It turns itself off for good when a computed
    output goes unclaimed (the members saw different tensors after all). Under
    ``torch.compile`` Dynamo traces the stash and the identity check as it traces any Python
    state: the group runs inside the graph.

    Args:
        name: how log lines and reports name the group.
        members: the projection modules, in the group's order.
    """

    def __init__(self, name: str, members: list[torch.nn.Module]):
        self.name = name
        self.members = members
        self.hooks: list[LinearHook] = []  # the members' hooks, in their order
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

    def output(self, module: torch.nn.Module, x: torch.Tensor, state: Live
               ) -> torch.Tensor | None:
        """Every member's output for ``x`` (``state``: ``module``'s); ``module``'s is returned,
        the others' kept for their calls. None where the group cannot run.
        """
        if not self.on:
            return None
        i = self._position(module)
        lives = [state if j == i else live(m, x, h)
                 for j, (m, h) in enumerate(zip(self.members, self.hooks, strict=True))]
        if any(lv is None or lv.dropout for lv in lives):
            return None
        outs = lora_projections(x, *[(lv.base, lv.a, lv.b, lv.scale) for lv in lives])
        self._stash = (x, {j: o for j, o in enumerate(outs) if j != i})
        return outs[i]

    def clear(self) -> None:
        """Drop outputs waiting to be claimed."""
        self._stash = None

    def _position(self, module: torch.nn.Module) -> int:
        return next(j for j, m in enumerate(self.members) if m is module)


def linear_hook(module: torch.nn.Module) -> LinearHook | None:
    """The :class:`LinearHook` installed on ``module``, if any: read from the module itself,
    so a projection replaced after :func:`~shuttle.train.accelerate` is never taken for the one
    it replaced.
    """
    return next((h for h in hooks_of(module) if isinstance(h, LinearHook)), None)


class MLPHook(TrainHook):
    """A gated MLP ``down(act(gate(x)) * up(x))`` as one
    :func:`~shuttle.train.lora_mlp.lora_mlp`, where its three projections can all take it.

    Args:
        names: the (gate, up, down, act) attribute names.
        act: the activation's name in :data:`~shuttle.kernels.gated.ACTIVATIONS`.
    """

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
            lv = live(m, x, linear_hook(m))
            if lv is None or lv.dropout:
                return inner(*args, **kwargs)
            lives.append(lv)
        return lora_mlp(x, self.act, *[(lv.base, lv.a, lv.b, lv.scale) for lv in lives])
