"""Offload a diffusers pipeline: every torch component under one cache, the denoiser streamed.

``offload(pipe, ...)`` leaves ``pipe(...)`` working unchanged: each component is activated on
the device when the pipeline calls it (``pipe.text_encoder(...)``, ``pipe.transformer(...)``,
``pipe.vae.decode(...)``) and taken off when another needs the room. The denoiser
(``transformer``/``unet``, and ``transformer_2`` and the like) streams its block lists. With a
``vram_budget`` the text encoders (every component but the autoencoders) are captured with their
block lists too and stream as far as the budget asks (all resident when they fit); the
autoencoders move whole and decode tiled (diffusers' own ``enable_tiling``/``enable_slicing``)
only once their measured activations do not fit the budget beside their weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shuttle.cache import ModelCache
from shuttle.errors import OffloadError
from shuttle.integrations.activations import ActivationMeter
from shuttle.integrations.blocks import find_block_lists
from shuttle.integrations.handle import OffloadHandle, cache_for
from shuttle.offload.host_storage import HostBacking
from shuttle.optional import import_optional

__all__ = ["DENOISERS", "ENTRY_METHODS", "offload"]

# Component names whose block lists stream by default (prefixes: ``transformer_2`` too).
DENOISERS = ("transformer", "unet")
# Methods pipelines call instead of ``forward`` (a VAE's ``encode``/``decode``).
ENTRY_METHODS = ("encode", "decode")
# The largest tile (pixels) of a VAE that shuttle switches to tiled decoding: diffusers' tiles
# are the model's sample size, 1024 for Flux's VAE, which would not split a 1024x1024 image.
_TILE = 512


class _Tiling:
    """Diffusers' own tiled and sliced decoding of ``vae`` (tiles of at most ``_TILE`` pixels),
    switched on when its activations do not fit; ``restore`` puts its settings back.
    """

    _SETTINGS = ("use_tiling", "use_slicing", "tile_sample_min_size", "tile_latent_min_size")

    def __init__(self, vae: torch.nn.Module):
        self.vae = vae
        self.saved: dict[str, Any] = {}

    def enable(self) -> None:
        vae = self.vae
        self.saved = {a: getattr(vae, a) for a in self._SETTINGS if hasattr(vae, a)}
        vae.enable_tiling()
        if callable(getattr(vae, "enable_slicing", None)):
            vae.enable_slicing()  # a batch decodes one image at a time
        sample, latent = (getattr(vae, "tile_sample_min_size", None),
                          getattr(vae, "tile_latent_min_size", None))
        if isinstance(sample, int) and isinstance(latent, int) and sample > _TILE:
            vae.tile_sample_min_size, vae.tile_latent_min_size = _TILE, latent * _TILE // sample

    def restore(self) -> None:
        for attr, value in self.saved.items():
            setattr(self.vae, attr, value)


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
            host: HostBacking = "pinned", meter: ActivationMeter | None = None) -> OffloadHandle:
    """Put every ``nn.Module`` component of ``pipe`` under one shuttle cache.

    Args:
        pipe: a ``diffusers.DiffusionPipeline``.
        max_host_bytes: host byte budget of a new cache for the components and adapters.
        cache: a :class:`~shuttle.ModelCache` to share instead (exclusive with
            ``max_host_bytes``).
        vram_budget: device bytes for the components active at once, weights and the running
            one's activations (measured on its calls); the denoiser and the text encoders make
            as many blocks resident as fit. None: one component active at a time, the denoiser
            streaming with no resident blocks, the others moved whole.
        device: where the components compute.
        prefetch: denoiser blocks loaded ahead of the one computing.
        blocks: component name -> block-list paths to stream, replacing the automatic choice
            for the names given (``[]``: move that component whole).
        host: ``"pinned"`` (page-locked copies) or ``"adopt"`` (keep the CPU tensors).
        meter: measures each call's activations (default: CUDA's allocator statistics; see
            :mod:`shuttle.integrations.activations`).

    Returns:
        The handle: ``set_loras``, ``deactivate``, ``remove`` (exact detach).

    Raises:
        MissingDependencyError: diffusers is not installed.
        OffloadError: ``pipe`` is not a ``DiffusionPipeline``, or is offloaded already.
        CacheError: both or neither of ``max_host_bytes`` and ``cache``.
        ResourceTooLargeError: the components do not fit in the host budget.
        BudgetTooSmallError: ``vram_budget`` cannot hold a component as planned (raised by a
            call too, after it, when its measured activations do not fit beside the
            component's floor).
        On any error the pipeline is as it was.
    """
    diffusers = import_optional("diffusers", "shuttle.integrations.diffusers",
                                "pip install diffusers")
    if not isinstance(pipe, diffusers.DiffusionPipeline):
        raise OffloadError(f"pipe is a {type(pipe).__name__}, not a diffusers.DiffusionPipeline")
    cache = cache_for(max_host_bytes, cache)
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    methods = {n: [a for a in ENTRY_METHODS if callable(getattr(type(m), a, None))]
               for n, m in modules.items()}
    # With a budget every component but the autoencoders may stream (their plan decides).
    paths = {n: find_block_lists(m) for n, m in modules.items()
             if n.startswith(DENOISERS) or (vram_budget is not None and not methods[n])}
    paths.update(blocks or {})
    shrink = {n: _Tiling(m) for n, m in modules.items()
              if methods[n] and callable(getattr(m, "enable_tiling", None))}
    return OffloadHandle(modules, paths, cache=cache, device=device, prefetch=prefetch,
                         vram_budget=vram_budget, host=host, methods=methods,
                         attrs={"_hf_hook": _ExecutionDevice(torch.device(device))},
                         key_prefix=f"{type(pipe).__name__}@{id(pipe):x}", shrink=shrink,
                         meter=meter)
