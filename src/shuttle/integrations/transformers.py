"""Offload a transformers model: its decoder layers streamed, everything else moved whole.

``offload(model, ...)`` leaves ``model(...)`` and ``model.generate(...)`` working unchanged:
the model is activated on the device at its first forward and stays active (each forward
streams the layers) until :meth:`~shuttle.integrations.handle.OffloadHandle.deactivate` or
``remove``. Inputs go on ``device``, as for any model there.

While offloaded, ``model.device`` is ``device`` (the parameters themselves live in host memory
between calls): ``generate`` reads it to place the tensors it makes (cache positions, beam
indices, the inputs it moves), as it does for a model that lives on ``device``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shuttle.cache import ModelCache
from shuttle.errors import OffloadError
from shuttle.integrations.activations import ActivationMeter
from shuttle.integrations.blocks import find_block_lists
from shuttle.integrations.handle import OffloadHandle, cache_for
from shuttle.offload.host_storage import HostBacking
from shuttle.optional import import_optional

__all__ = ["offload"]

_EXECUTION_DEVICE = "_shuttle_execution_device"
_DEVICE_CLASSES: dict[type, type] = {}


def _reporting_device(cls: type) -> type:
    """A subclass of ``cls`` (adding no state) whose ``device`` is the compute device.

    ``PreTrainedModel.device`` is a property reading the first parameter's device, so an
    instance attribute cannot shadow it; the offloaded instance takes this class instead, and
    its own class back at ``remove()``. One subclass per model class, made once.
    """
    sub = _DEVICE_CLASSES.get(cls)
    if sub is None:
        def device(self: Any) -> torch.device:
            return self.__dict__[_EXECUTION_DEVICE]

        sub = _DEVICE_CLASSES[cls] = type(cls.__name__, (cls,), {
            "device": property(device, doc="The device the offloaded model computes on."),
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__})
    return sub


def offload(model: Any, max_host_bytes: int | None = None, *, cache: ModelCache | None = None,
            vram_budget: int | None = None, device: str | torch.device = "cuda",
            prefetch: int = 2, blocks: Sequence[str] | None = None,
            host: HostBacking = "pinned", meter: ActivationMeter | None = None) -> OffloadHandle:
    """Keep ``model`` in host memory and stream its layers on every forward.

    Args:
        model: a ``transformers.PreTrainedModel`` (``LlamaForCausalLM``, ...).
        max_host_bytes: host byte budget of a new cache for the model and its adapters.
        cache: a :class:`~shuttle.ModelCache` to share instead (exclusive with
            ``max_host_bytes``).
        vram_budget: device bytes for the weights and the activations of each call (measured:
            the first call runs with every layer streamed, later ones keep as many layers
            resident as fit beside the activations). None: all layers stream, ``prefetch``
            ahead.
        device: where the model computes.
        prefetch: layers loaded ahead of the one computing.
        blocks: block-list paths to stream (default: the uniform layer lists holding most of
            the weights, e.g. ``model.layers`` or ``transformer.h``; ``[]``: move it whole).
        host: ``"pinned"`` (page-locked copies) or ``"adopt"`` (keep the CPU tensors).
        meter: measures each call's activations (default: CUDA's allocator statistics; see
            :mod:`shuttle.integrations.activations`).

    Returns:
        The handle (its one module is named ``"model"``): ``set_loras``, ``deactivate``,
        ``remove``.

    Raises:
        MissingDependencyError: transformers is not installed.
        OffloadError: ``model`` is not a ``PreTrainedModel``, or is offloaded already.
        CacheError: both or neither of ``max_host_bytes`` and ``cache``.
        ResourceTooLargeError: the model does not fit in the host budget.
        BudgetTooSmallError: ``vram_budget`` cannot hold the non-layer weights and one slot.
        On any error the model is as it was.
    """
    transformers = import_optional("transformers", "shuttle.integrations.transformers",
                                   "pip install transformers")
    if not isinstance(model, transformers.PreTrainedModel):
        raise OffloadError(f"model is a {type(model).__name__}, not a "
                           "transformers.PreTrainedModel")
    cache = cache_for(max_host_bytes, cache)
    paths = find_block_lists(model) if blocks is None else list(blocks)
    device = torch.device(device)
    return OffloadHandle({"model": model}, {"model": paths}, cache=cache, device=device,
                         prefetch=prefetch, vram_budget=vram_budget, host=host,
                         attrs={_EXECUTION_DEVICE: device},
                         classes={"model": _reporting_device(type(model))},
                         key_prefix=f"{type(model).__name__}@{id(model):x}", meter=meter)
