"""Offload a diffusers pipeline: every torch component under one cache, the denoiser streamed.

``offload(pipe, ...)`` leaves ``pipe(...)`` working unchanged: each component is activated on
the device when the pipeline calls it (``pipe.text_encoder(...)``, ``pipe.transformer(...)``,
``pipe.vae.decode(...)``) and taken off when another needs the room. The denoiser
(``transformer``/``unet``, and ``transformer_2`` and the like) streams its block lists. With a
``vram_budget`` the text encoders (every component but the autoencoders) are captured with their
block lists too and stream as far as the budget asks (all resident when they fit); the
autoencoders move whole and decode tiled (diffusers' own ``enable_tiling``/``enable_slicing``)
only when their activations do not fit the budget beside their weights: predicted before their
first call by running it on a ``meta`` twin, measured on every call.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch.utils._pytree import tree_map_only

from shuttle.byte_count import ByteCount
from shuttle.cache import ModelCache
from shuttle.errors import AdapterFileError, InvalidOptionError, OffloadError
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.integrations.activations import ActivationMeter, meta_peak
from shuttle.integrations.blocks import find_block_lists
from shuttle.integrations.budgets import byte_budgets, cache_for, check_device, files_ceiling
from shuttle.integrations.component import reporting
from shuttle.integrations.handle import OffloadHandle
from shuttle.integrations.pretrained import (
    file_tensors,
    folder_tensors,
    local_folder,
    match_sources,
    meta_parameters,
    weights_dtype,
)
from shuttle.integrations.single_file import RowPieces, place_original
from shuttle.integrations.transformers import empty_model
from shuttle.offload.coded import Compression
from shuttle.offload.host_storage import HostBacking
from shuttle.optional import import_optional
from shuttle.weights.fp8 import FP8_DTYPES

logger = logging.getLogger(__name__)

__all__ = ["DENOISERS", "ENTRY_METHODS", "Float8", "empty_components", "from_pretrained",
           "offload"]

# What from_pretrained does with float8 parameters in a diffusers model's files.
Float8 = Literal["keep", "widen"]
# Component names whose block lists stream by default (prefixes: ``transformer_2`` too).
DENOISERS = ("transformer", "unet")
# Methods pipelines call instead of ``forward`` (a VAE's ``encode``/``decode``).
ENTRY_METHODS = ("encode", "decode")
# The largest tile (pixels) of a VAE that shuttle switches to tiled decoding: diffusers' tiles
# are the model's sample size, 1024 for Flux's VAE, which would not split a 1024x1024 image.
_TILE = 512


class _Tiling:
    """Diffusers' own tiled and sliced decoding of ``vae`` (tiles of at most ``_TILE`` pixels),
    switched on when its activations do not fit; ``restore`` puts its settings back;
    ``predict`` runs a call on a twin of ``vae`` built on ``meta`` from its config.
    """

    _SETTINGS = ("use_tiling", "use_slicing", "tile_sample_min_size", "tile_latent_min_size")

    def __init__(self, vae: torch.nn.Module):
        self.vae = vae
        self.saved: dict[str, Any] = {}
        self.twin: torch.nn.Module | None = None

    def predict(self, method: str, args: tuple[Any, ...],
                kwargs: Mapping[str, Any]) -> int | None:
        """The activation bytes of ``vae.method(*args, **kwargs)`` at its current settings
        (:func:`~shuttle.integrations.activations.meta_peak` over the twin's call); None when
        the VAE cannot be built from its config or the call does not run on ``meta``.
        """
        try:
            twin = self._twin()
            for attr in self._SETTINGS:
                if hasattr(self.vae, attr):
                    setattr(twin, attr, getattr(self.vae, attr))
            call = getattr(twin, method)
            on_meta = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, dict(kwargs)))
            with torch.no_grad():
                return meta_peak(lambda: call(*on_meta[0], **on_meta[1]))
        except Exception as e:  # noqa: BLE001 (a prediction only: the call is measured anyway)
            logger.info("%s.%s: no prediction of its activations (%s: %s); its first call is "
                        "measured as it runs", type(self.vae).__name__, method,
                        type(e).__name__, e)
            return None

    def _twin(self) -> torch.nn.Module:
        """``vae``'s architecture on ``meta``, each parameter in the dtype ``vae`` computes
        its own in (float8 storage computes in the model's reported dtype).
        """
        if self.twin is None:
            with torch.device("meta"):
                twin = type(self.vae).from_config(self.vae.config)
            own = dict(self.vae.named_parameters())
            compute = getattr(self.vae, "dtype", torch.float32)
            for name, p in twin.named_parameters():
                dtype = own[name].dtype if name in own else compute
                p.data = p.data.to(compute if dtype in FP8_DTYPES else dtype)
            self.twin = twin.eval()
        return self.twin

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


def _computing_in(cls: type, dtype: torch.dtype) -> type:
    """``cls`` whose ``dtype`` is ``dtype``: a model holding float8 weights that compute in
    ``dtype`` reports it, as diffusers' layerwise casting makes ``ModelMixin.dtype`` report its
    compute dtype (pipelines cast their inputs and embeddings to a component's ``dtype``).
    """
    return reporting(cls, "dtype", lambda self: dtype, "The dtype the model computes in.",
                     key=dtype)


@dataclass(frozen=True)
class _ExecutionDevice:
    """Tells ``DiffusionPipeline._execution_device`` where the components compute.

    Without it the pipeline would read the device of its (host-resident) parameters and build
    latents and embeddings on the CPU. The pipeline looks for ``_hf_hook.execution_device`` on
    its components (the attribute accelerate's offload hooks carry); this object has no
    ``pre_forward``, so diffusers' ``apply_forward_hook`` does not call into it.
    """

    execution_device: torch.device


def offload(pipe: Any, max_host_bytes: ByteCount | None = None, *, cache: ModelCache | None = None,
            vram_budget: ByteCount | None = None, device: str | torch.device = "cuda",
            prefetch: int = 2, blocks: Mapping[str, Sequence[str]] | None = None,
            host: HostBacking = "pinned", meter: ActivationMeter | None = None,
            sources: Mapping[str, Mapping[str, LazyTensor]] | None = None,
            compress: Compression | None = None,
            upcast: Mapping[str, torch.dtype] | None = None) -> OffloadHandle:
    """Put every ``nn.Module`` component of ``pipe`` under one shuttle cache.

    Args:
        pipe: a ``diffusers.DiffusionPipeline``.
        max_host_bytes: host byte budget of a new cache for the components and adapters.
            This and ``vram_budget`` are bytes, or as :func:`~shuttle.byte_count.byte_count`
            reads them (``6e9``, ``"16GiB"``); ``"auto"``: what the machine has free now
            (the host memory available within the process's cgroup limit less 2 GiB; the
            device's free memory less a tenth, at least 512 MiB).
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
        compress: ``"lossless"``: keep the bfloat16/float16 weights coded in host memory and
            decode them on the device as they land (about 0.7x the host bytes and the bytes
            over the bus, bit for bit; docs/lossless.md). Needs ``host="pinned"``.
        sources: component name -> (qualified tensor name -> its tensor in a safetensors
            file), for components built on ``meta`` (see :func:`from_pretrained`).
        upcast: component name -> the dtype a component holding float8 weights computes in
            (each module runs with its float8 parameters cast to it,
            :func:`~shuttle.upcast_on_use`; its ``dtype`` reports it while offloaded).
            :func:`from_pretrained` passes it for the components whose files hold float8.

    Returns:
        The handle: ``set_loras``, ``deactivate``, ``remove`` (exact detach).

    Raises:
        MissingDependencyError: diffusers is not installed.
        OffloadError: ``pipe`` is not a ``DiffusionPipeline``, or is offloaded already;
            ``vram_budget="auto"`` for a device that is not CUDA, or with no more than its
            reserve free.
        CacheError: both or neither of ``max_host_bytes`` and ``cache``.
        HostMemoryError: ``max_host_bytes="auto"`` where the system does not say what is
            available, or no more than 2 GiB is.
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
    device = check_device(device)
    vram_budget, max_host_bytes = byte_budgets(vram_budget, max_host_bytes, device)
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    unknown = sorted(set(upcast or {}) - set(modules))
    if unknown:
        raise OffloadError(f"upcast= names {unknown}, which are not module components of the "
                           f"pipeline ({sorted(modules)})")
    cache = cache_for(max_host_bytes, cache)
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
                         attrs={"_hf_hook": _ExecutionDevice(device)},
                         key_prefix=f"{type(pipe).__name__}@{id(pipe):x}", shrink=shrink,
                         meter=meter, sources=sources, compress=compress, upcast=upcast,
                         classes={n: _computing_in(type(modules[n]), d)
                                  for n, d in (upcast or {}).items()},
                         hot=[n for n in modules if n.startswith(DENOISERS)])


def from_pretrained(path_or_repo: str | os.PathLike[str], pipeline_cls: type | None = None, *,
                    torch_dtype: torch.dtype | str | None = None,
                    vram_budget: ByteCount | None = None, max_host_bytes: ByteCount | None = None,
                    cache: ModelCache | None = None,
                    device: str | torch.device = "cuda", prefetch: int = 2,
                    blocks: Mapping[str, Sequence[str]] | None = None,
                    host: HostBacking = "pinned", revision: str | None = None,
                    weights: Mapping[str, str | os.PathLike[str]] | None = None,
                    compress: Compression | None = None, float8: Float8 = "keep",
                    **components: Any) -> tuple[Any, OffloadHandle]:
    """Build a diffusers pipeline straight from its files and offload it.

    Every ``nn.Module`` component named in ``model_index.json`` is built on ``meta`` from its
    config (buffers real), and its weights are read once from its folder's safetensors (one
    file, or an index and its shards) into shuttle's host storage: no full CPU copy of the
    pipeline is made. Tokenizers, schedulers and the like load as diffusers loads them.

    Args:
        path_or_repo: a folder written by ``save_pretrained``, or a Hub repo id (fetched with
            ``huggingface_hub``: ``model_index.json`` and the components' folders, safetensors
            weights only).
        pipeline_cls: the pipeline class; None: ``model_index.json``'s ``_class_name``.
        torch_dtype: the dtype of the floating-point weights (files of another floating dtype
            are converted while read). None: as ``DiffusionPipeline.from_pretrained``, float32
            for diffusers models and the config's dtype for transformers models. Modules
            their library keeps in float32 (``_keep_in_fp32_modules``) stay float32. A name
            works too (``"bfloat16"``, ``"bf16"``, ``"fp16"``; ``"auto"``: None).
        vram_budget, max_host_bytes, cache, device, prefetch, blocks, host: as for
            :func:`offload`; with neither ``max_host_bytes`` nor ``cache``, a cache without a
            ceiling, refused where the weights do not fit in the host memory available
            (``max_host_bytes="auto"`` holds what fits and reads the rest from the files).
        revision: the Hub revision of a repo id.
        compress: ``"lossless"``: the weights kept coded in host memory (see :func:`offload`);
            under ``max_host_bytes`` the units in host memory are kept coded (more fit) and
            the others read from the files as they are (coded where ``shuttle compress``
            wrote them).
        weights: component name -> a safetensors file to read its weights from instead of its
            folder (which then gives only its config): an original single-file checkpoint
            (``flux1-dev.safetensors``, ComfyUI's ``model.diffusion_model.`` keys), placed by
            shuttle's family tables (:mod:`~shuttle.integrations.single_file`), or a file in
            the model's own names.
        float8: what becomes of the parameters a diffusers model's files store in float8
            (fp8 checkpoints): ``"keep"``, held as stored (half the bytes of bfloat16 in host
            memory, read from disk and streamed) and cast to ``torch_dtype`` (float32 when
            None) as each module runs (:func:`~shuttle.upcast_on_use`; the model's ``dtype``
            reports ``torch_dtype``): the same values as widened ones, so the outputs are
            those of a widening load; ``"widen"``: widened into the model's dtype while read
            (exact; a module holding one is held in host memory, not read from disk).
            Modules kept in float32 and transformers models (text encoders) always widen.
        components: components to use as given instead of reading them (``scheduler=...``,
            or a module already loaded: it is offloaded from its own tensors).

    Returns:
        ``(pipe, handle)``: ``pipe(...)`` works unchanged; :meth:`OffloadHandle.remove` leaves
        the components built here on ``meta``.

    Raises:
        MissingDependencyError: diffusers or transformers (or huggingface_hub, for a repo id)
            is missing.
        AdapterFileError: no such folder or repo, no ``model_index.json``, or a component
            without config or safetensors weights.
        CheckpointMismatchError: file tensors a component lacks (beyond those its library
            ignores) or of another shape.
        MissingParameterError: a parameter that no file of its component holds.
        OffloadError: a pipeline or component class the installed diffusers lacks.
        InvalidOptionError: a ``torch_dtype`` that is not a floating-point dtype or its name.
        HostMemoryError: no ceiling given and the weights (at their stored dtypes) exceed
            the host memory available less 2 GiB; or ``"auto"`` with nothing to give.
        Whatever :func:`offload` raises (budgets, devices).
    """
    diffusers = import_optional("diffusers", "shuttle.integrations.diffusers",
                                "pip install diffusers")
    target = check_device(device)  # every argument checked before anything is read or built
    vram_budget, max_host_bytes = byte_budgets(vram_budget, max_host_bytes, target)
    torch_dtype = weights_dtype(torch_dtype)
    if float8 not in get_args(Float8):
        raise InvalidOptionError(f"float8={float8!r}: expected 'keep' (float8 weights held "
                                 "as stored, cast as each module runs) or 'widen' (converted "
                                 "while read)")
    folder = local_folder(path_or_repo, revision, ["model_index.json"])
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise AdapterFileError(f"{folder}: no model_index.json; pass a folder written by a "
                               "diffusers pipeline's save_pretrained")
    index = json.loads(index_file.read_text())
    parts = _model_parts(index)
    weights = dict(weights or {})
    folder = local_folder(path_or_repo, revision,
                          [f"{n}/config.json" if n in weights else f"{n}/*" for n in parts],
                          ["*.*.safetensors", "*.safetensors.index.*.json"])  # variants
    unknown = sorted(set(weights) - set(parts))
    if unknown:
        raise OffloadError(f"weights= names {unknown}, which {folder}/model_index.json lacks; "
                           f"its components are {sorted(parts)}")
    if pipeline_cls is None:
        pipeline_cls = getattr(diffusers, str(index.get("_class_name")), None)
        if pipeline_cls is None:
            raise OffloadError(f"{folder}: diffusers {diffusers.__version__} has no pipeline "
                               f"{index.get('_class_name')!r}; upgrade it or pass pipeline_cls=")
    modules: dict[str, torch.nn.Module] = {}
    sources: dict[str, dict[str, LazyTensor]] = {}
    upcast: dict[str, torch.dtype] = {}
    for name, (library, class_name) in parts.items():
        cls = _component_class(library, class_name)
        if name in components or cls is None:
            continue  # given, or not a module: the pipeline loads it
        if issubclass(cls, diffusers.ModelMixin):
            modules[name], sources[name] = _empty_model(cls, folder / name, torch_dtype,
                                                        weights.get(name))
            compute = torch_dtype or torch.float32
            if float8 == "keep" and _keep_float8(modules[name], sources[name], compute):
                upcast[name] = compute
        else:
            modules[name], sources[name] = empty_model(folder / name, cls, torch_dtype,
                                                       weights.get(name))
    max_host_bytes = files_ceiling(max_host_bytes, cache, modules.values(), compress,
                                   "diffusers.from_pretrained")
    pipe = pipeline_cls.from_pretrained(folder, **modules, **components)
    logger.info("%s: %s built, modules %s on meta; reading their weights", folder,
                pipeline_cls.__name__, sorted(modules))
    handle = offload(pipe, max_host_bytes, cache=cache, vram_budget=vram_budget, device=device,
                     prefetch=prefetch, blocks=blocks, host=host, sources=sources,
                     compress=compress, upcast=upcast)
    return pipe, handle


def _model_parts(index: Mapping[str, Any]) -> dict[str, list[str]]:
    """The components a ``model_index.json`` names: name -> [library, class name]."""
    return {n: v for n, v in index.items() if not n.startswith("_") and isinstance(v, list)
            and len(v) == 2 and v[0] is not None}


def empty_components(folder: Path, torch_dtype: torch.dtype | None
                     ) -> list[tuple[torch.nn.Module, dict[str, LazyTensor | RowPieces]]]:
    """Each module component of the pipeline ``folder`` on ``meta``, built as
    :func:`from_pretrained` builds it, with its file tensors (what
    :func:`shuttle.integrations.cast.cast` reads dtypes from).
    """
    diffusers = import_optional("diffusers", "shuttle.integrations.diffusers",
                                "pip install diffusers")
    built = []
    for name, (library, class_name) in _model_parts(
            json.loads((folder / "model_index.json").read_text())).items():
        cls = _component_class(library, class_name)
        if cls is None:
            continue
        if issubclass(cls, diffusers.ModelMixin):
            built.append(_empty_model(cls, folder / name, torch_dtype))
        else:
            built.append(empty_model(folder / name, cls, torch_dtype))
    return built


def _component_class(library: str, class_name: str) -> type | None:
    """The class of a ``nn.Module`` component (None for tokenizers, schedulers, ...).

    Raises:
        OffloadError: a module class the installed library lacks.
    """
    if library not in ("diffusers", "transformers"):
        return None  # a custom pipeline's own module: diffusers loads it
    lib = import_optional(library, "shuttle.integrations.diffusers", f"pip install {library}")
    cls = getattr(lib, class_name, None)
    if cls is None:
        raise OffloadError(f"{library} {lib.__version__} has no {class_name!r} (named in "
                           f"model_index.json); upgrade {library}")
    return cls if isinstance(cls, type) and issubclass(cls, torch.nn.Module) else None


def _keep_float8(model: torch.nn.Module, sources: Mapping[str, LazyTensor | RowPieces],
                 dtype: torch.dtype) -> bool:
    """Give ``model`` (on ``meta``) a float8 parameter wherever its files store that parameter
    in float8 and the model built it in ``dtype``, its compute dtype (not a module its library
    keeps in float32: those are widened into float32); whether any.

    The values are the same as widened ones, so every module computes exactly as after a
    widening load, and a block whose tensors all lie in its files as stored can stay on disk.
    """
    kept = False
    for path, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            src = sources.get(f"{path}.{leaf}" if path else leaf)
            if src is not None and src.dtype in FP8_DTYPES and p.dtype == dtype:
                p.data = torch.empty(p.shape, dtype=src.dtype, device=p.device)  # still meta
                kept = True
    return kept


def _empty_model(cls: type, folder: Path, torch_dtype: torch.dtype | None,
                 file: str | os.PathLike[str] | None = None
                 ) -> tuple[torch.nn.Module, dict[str, LazyTensor | RowPieces]]:
    """A diffusers model of ``folder``'s config on ``meta``, and its file tensors: built as
    diffusers' ``from_pretrained`` builds it (under ``torch_dtype`` as the default dtype, its
    float32 modules, old attention key names renamed); from ``file`` instead of the folder's
    weights when given, original names placed by the family tables.
    """
    if not (folder / "config.json").is_file():
        raise AdapterFileError(f"{folder}: no config.json; pass a folder written by "
                               "save_pretrained")
    config = cls.load_config(folder)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype or torch.float32)
    try:
        with meta_parameters():
            model = cls.from_config(config)
    finally:
        torch.set_default_dtype(before)
    model.register_to_config(_name_or_path=str(folder))
    model.eval()
    if file is None:
        tensors = folder_tensors(folder)
        fix = getattr(model, "_fix_state_dict_keys_on_load", None)
        if fix is not None:  # VAE attention blocks saved under their old names
            fix(tensors)
    else:
        tensors = place_original(model, file_tensors(file), str(file))
    keep = (cls._keep_in_fp32_modules or []) if torch_dtype is not None else []
    keep = [keep] if isinstance(keep, str) else keep
    return model, match_sources(
        model, tensors, str(folder), ignore=cls._keys_to_ignore_on_load_unexpected or (),
        float32=lambda n: any(m in n.split(".") for m in keep))
