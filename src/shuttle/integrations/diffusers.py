"""Offload a diffusers pipeline: every torch component under one cache, the denoiser streamed.

``offload(pipe, ...)`` leaves ``pipe(...)`` working unchanged: each component is activated on
the device when the pipeline calls it (``pipe.text_encoder(...)``, ``pipe.transformer(...)``,
``pipe.vae.decode(...)``) and taken off when another needs the room. The denoiser
(``transformer``/``unet``, and ``transformer_2`` and the like) streams its block lists; the
other components move whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shuttle.cache import ModelCache
from shuttle.errors import OffloadError
from shuttle.integrations.blocks import find_block_lists
from shuttle.integrations.handle import OffloadHandle, cache_for
from shuttle.offload.host_storage import HostBacking
from shuttle.optional import import_optional

__all__ = ["DENOISERS", "ENTRY_METHODS", "offload"]

# Component names whose block lists stream by default (prefixes: ``transformer_2`` too).
DENOISERS = ("transformer", "unet")
# Methods pipelines call instead of ``forward`` (a VAE's ``encode``/``decode``).
ENTRY_METHODS = ("encode", "decode")


@dataclass(frozen=True)
class _ExecutionDevice:
    """Tells ``DiffusionPipeline._execution_device`` where the components compute.

    Without it the pipeline would read the device of its (host-resident) parameters and build
    latents and embeddings on the CPU. The pipeline looks for ``_hf_hook.execution_device`` on
    its components (the attribute accelerate's offload hooks carry); this object has no
    ``pre_forward``, so diffusers' ``apply_forward_hook`` does not call into it.
    """

    execution_device: torch.device


def offload(pipe: Any, max_host_bytes: int | None = None, *, cache: ModelCache | None = None,
            vram_budget: int | None = None, device: str | torch.device = "cuda",
            prefetch: int = 2, blocks: Mapping[str, Sequence[str]] | None = None,
            host: HostBacking = "pinned") -> OffloadHandle:
    """Put every ``nn.Module`` component of ``pipe`` under one shuttle cache.

    Args:
        pipe: a ``diffusers.DiffusionPipeline``.
        max_host_bytes: host byte budget of a new cache for the components and adapters.
        cache: a :class:`~shuttle.ModelCache` to share instead (exclusive with
            ``max_host_bytes``).
        vram_budget: device bytes for weights of the components active at once; the denoiser
            makes as many blocks resident as fit. None: one component active at a time, the
            denoiser streaming with no resident blocks.
        device: where the components compute.
        prefetch: denoiser blocks loaded ahead of the one computing.
        blocks: component name -> block-list paths to stream, replacing the automatic choice
            for the names given (``[]``: move that component whole).
        host: ``"pinned"`` (page-locked copies) or ``"adopt"`` (keep the CPU tensors).

    Returns:
        The handle: ``set_loras``, ``deactivate``, ``remove`` (exact detach).

    Raises:
        MissingDependencyError: diffusers is not installed.
        OffloadError: ``pipe`` is not a ``DiffusionPipeline``, or is offloaded already.
        CacheError: both or neither of ``max_host_bytes`` and ``cache``.
        ResourceTooLargeError: the components do not fit in the host budget.
        BudgetTooSmallError: ``vram_budget`` cannot hold a component as planned.
        On any error the pipeline is as it was.
    """
    diffusers = import_optional("diffusers", "shuttle.integrations.diffusers",
                                "pip install diffusers")
    if not isinstance(pipe, diffusers.DiffusionPipeline):
        raise OffloadError(f"pipe is a {type(pipe).__name__}, not a diffusers.DiffusionPipeline")
    cache = cache_for(max_host_bytes, cache)
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    paths = {n: find_block_lists(m) for n, m in modules.items() if n.startswith(DENOISERS)}
    paths.update(blocks or {})
    methods = {n: [a for a in ENTRY_METHODS if callable(getattr(type(m), a, None))]
               for n, m in modules.items()}
    return OffloadHandle(modules, paths, cache=cache, device=device, prefetch=prefetch,
                         vram_budget=vram_budget, host=host, methods=methods,
                         attrs={"_hf_hook": _ExecutionDevice(torch.device(device))},
                         key_prefix=f"{type(pipe).__name__}@{id(pipe):x}")
