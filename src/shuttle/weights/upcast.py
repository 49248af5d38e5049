"""Compute with float8-stored weights: each layer's float8 parameters cast up as it runs.

A float8 checkpoint (``float8_e4m3fn`` / ``float8_e5m2`` parameters, unscaled, as the common
fp8 Flux and Wan files store them) keeps half the bytes of bfloat16 in memory, on the host and
in every copy the offloader makes, but ``nn.Linear`` and friends cannot compute with it.
:func:`upcast_on_use` hooks every module that holds such parameters: during its forward each of
them is replaced by a compute-dtype copy (one cast kernel, freed after the forward), and the
stored parameter is put back after. Composes with the offloader (its stream hooks bind the
float8 slot views first, so only float8 bytes cross the bus), with merges (``merge_lora`` into
float8 parameters re-encodes them) and with dynamic adapters (planned with the compute dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shuttle.errors import ShuttleError
from shuttle.hooks import HookGroup, ModuleHook, hooks_of
from shuttle.kernels.upcast import upcast
from shuttle.weights.fp8 import FP8_DTYPES

__all__ = ["UpcastHook", "Upcasting", "upcast_on_use"]

_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class UpcastHook(ModuleHook):
    """Runs a module's forward with its float8 parameters (``names``) cast to ``dtype``."""

    def __init__(self, names: tuple[str, ...], dtype: torch.dtype):
        self.names = names
        self.dtype = dtype

    def forward(self, module: torch.nn.Module, inner: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
        params = module._parameters
        stored = {n: params[n] for n in self.names}
        try:
            grad = torch.is_grad_enabled()
            for n, p in stored.items():
                # A plain tensor in the parameter's place for this call only. Without autograd,
                # the hardware conversion kernel (PyTorch's float8 cast decodes in software);
                # with it, the differentiable cast, so a trainable parameter gets its gradient.
                params[n] = (p.to(self.dtype) if grad and p.requires_grad  # type: ignore[assignment]
                             else upcast(p.detach(), self.dtype))
            return inner(*args, **kwargs)
        finally:
            params.update(stored)


class Upcasting:
    """The hooks :func:`upcast_on_use` installed; :meth:`remove` takes them all off exactly.

    Attributes:
        modules: the names of the hooked modules, in model order.
        dtype: the compute dtype.
    """

    def __init__(self, modules: list[str], dtype: torch.dtype, hooks: HookGroup):
        self.modules = modules
        self.dtype = dtype
        self._hooks = hooks

    def remove(self) -> None:
        """Remove every hook (idempotent); the model is exactly as before."""
        self._hooks.remove_all()

    def __enter__(self) -> Upcasting:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def upcast_on_use(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> Upcasting:
    """Let ``model`` compute with float8 parameters: each module holding some runs with them
    cast to ``dtype`` (the stored float8 tensors stay as they are).

    Args:
        model: the model; every module with a float8 parameter of its own is hooked.
        dtype: the compute dtype (bfloat16, float16 or float32); the activations should have it.

    Returns:
        An :class:`Upcasting` handle (also a context manager) whose ``remove()`` undoes it.

    Raises:
        ShuttleError: ``dtype`` is no compute dtype, the model holds no float8 parameter, or a
            module is hooked already (call ``remove()`` on the earlier handle first).
    """
    if dtype not in _COMPUTE_DTYPES:
        raise ShuttleError(f"upcast_on_use: dtype {dtype} is not a compute dtype; use one of "
                           f"{_COMPUTE_DTYPES}")
    found = [(name, m, tuple(n for n, p in m.named_parameters(recurse=False)
                             if p.dtype in FP8_DTYPES))
             for name, m in model.named_modules()]
    found = [(name, m, names) for name, m, names in found if names]
    if not found:
        raise ShuttleError("upcast_on_use: the model holds no float8 parameter; it computes in "
                           "its own dtypes already")
    for name, m, _ in found:
        if any(isinstance(h, UpcastHook) for h in hooks_of(m)):
            raise ShuttleError(f"upcast_on_use: {name or 'the model'} is hooked already; call "
                               "remove() on the earlier handle first")
    hooks = HookGroup()
    for _, m, names in found:
        hooks.add(m, UpcastHook(names, dtype))
    return Upcasting([name for name, _, _ in found], dtype, hooks)
