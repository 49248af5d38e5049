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

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from shuttle.byte_count import ByteCount
from shuttle.cache import ModelCache
from shuttle.errors import AdapterFileError, OffloadError
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.integrations.activations import ActivationMeter
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
    read_dtype,
    weights_dtype,
)
from shuttle.offload.coded import Compression
from shuttle.offload.host_storage import HostBacking
from shuttle.optional import import_optional

__all__ = ["empty_model", "from_pretrained", "offload"]

# What from_pretrained fetches of a Hub repo: the config and the safetensors weights.
_MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors",
                "model.safetensors.index.json", "model-*-of-*.safetensors"]

_EXECUTION_DEVICE = "_shuttle_execution_device"


def _reporting_device(cls: type) -> type:
    """``cls`` whose ``device`` is the compute device (``PreTrainedModel.device`` reads the
    first parameter's, which lives in host memory between calls).
    """
    return reporting(cls, "device", lambda self: self.__dict__[_EXECUTION_DEVICE],
                     "The device the offloaded model computes on.")


def offload(model: Any, max_host_bytes: ByteCount | None = None, *, cache: ModelCache | None = None,
            vram_budget: ByteCount | None = None, device: str | torch.device = "cuda",
            prefetch: int = 2, blocks: Sequence[str] | None = None,
            host: HostBacking = "pinned", meter: ActivationMeter | None = None,
            sources: Mapping[str, LazyTensor] | None = None,
            compress: Compression | None = None) -> OffloadHandle:
    """Keep ``model`` in host memory and stream its layers on every forward.

    Args:
        model: a ``transformers.PreTrainedModel`` (``LlamaForCausalLM``, ...).
        max_host_bytes: host byte budget of a new cache for the model and its adapters.
            This and ``vram_budget`` are bytes, or as :func:`~shuttle.byte_count.byte_count`
            reads them (``6e9``, ``"16GiB"``); ``"auto"``: what the machine has free now
            (the host memory available within the process's cgroup limit less 2 GiB; the
            device's free memory less a tenth, at least 512 MiB).
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
        compress: ``"lossless"``: keep the bfloat16/float16 weights coded in host memory and
            decode them on the device as they land (about 0.7x the host bytes and the bytes
            over the bus, bit for bit; docs/lossless.md). Needs ``host="pinned"``.
        sources: qualified tensor name -> its tensor in a safetensors file, for a model built
            on ``meta`` (see :func:`from_pretrained`, which passes them).

    Returns:
        The handle (its one module is named ``"model"``): ``set_loras``, ``deactivate``,
        ``remove``.

    Raises:
        MissingDependencyError: transformers is not installed.
        OffloadError: ``model`` is not a ``PreTrainedModel``, or is offloaded already;
            ``vram_budget="auto"`` for a device that is not CUDA, or with no more than its
            reserve free.
        CacheError: both or neither of ``max_host_bytes`` and ``cache``.
        HostMemoryError: ``max_host_bytes="auto"`` where the system does not say what is
            available, or no more than 2 GiB is.
        ResourceTooLargeError: the model does not fit in the host budget.
        BudgetTooSmallError: ``vram_budget`` cannot hold the non-layer weights and one slot.
        On any error the model is as it was.
    """
    transformers = import_optional("transformers", "shuttle.integrations.transformers",
                                   "pip install transformers")
    if not isinstance(model, transformers.PreTrainedModel):
        raise OffloadError(f"model is a {type(model).__name__}, not a "
                           "transformers.PreTrainedModel")
    device = check_device(device)
    vram_budget, max_host_bytes = byte_budgets(vram_budget, max_host_bytes, device)
    cache = cache_for(max_host_bytes, cache)
    paths = find_block_lists(model) if blocks is None else list(blocks)
    return OffloadHandle({"model": model}, {"model": paths}, cache=cache, device=device,
                         prefetch=prefetch, vram_budget=vram_budget, host=host,
                         attrs={_EXECUTION_DEVICE: device},
                         classes={"model": _reporting_device(type(model))},
                         key_prefix=f"{type(model).__name__}@{id(model):x}", meter=meter,
                         sources={"model": sources} if sources is not None else None,
                         compress=compress)



def from_pretrained(path_or_repo: str | os.PathLike[str], model_cls: type | None = None, *,
                    torch_dtype: torch.dtype | str | None = None,
                    vram_budget: ByteCount | None = None, max_host_bytes: ByteCount | None = None,
                    cache: ModelCache | None = None,
                    device: str | torch.device = "cuda", prefetch: int = 2,
                    blocks: Sequence[str] | None = None, host: HostBacking = "pinned",
                    revision: str | None = None,
                    compress: Compression | None = None) -> tuple[Any, OffloadHandle]:
    """Build a transformers model straight from its files and offload it.

    The model is built on ``meta`` from its ``config.json`` (buffers real, see
    :func:`~shuttle.integrations.pretrained.meta_parameters`), its weights tied as its config
    says, and every weight is read once from the safetensors files (one file, or an index
    and its shards) into shuttle's host storage: no full CPU copy of the model is made.

    Args:
        path_or_repo: a folder written by ``save_pretrained``, or a Hub repo id (fetched
            with ``huggingface_hub``: the config and safetensors weights only).
        model_cls: the class to build (``LlamaForCausalLM``, or an auto class such as
            ``AutoModelForCausalLM``); None: the config's ``architectures[0]``.
        torch_dtype: the dtype of the floating-point weights (files of another floating dtype
            are converted while read); None: the config's dtype, else the files', as
            transformers' ``dtype="auto"``. Modules transformers keeps in float32 for this
            dtype (``_keep_in_fp32_modules``) stay float32. A name works too (``"bfloat16"``,
            ``"bf16"``, ``"fp16"``; ``"auto"``: None).
        vram_budget, max_host_bytes, cache, device, prefetch, blocks, host: as for
            :func:`offload`; with neither ``max_host_bytes`` nor ``cache``, a cache without a
            ceiling, refused where the weights do not fit in the host memory available
            (``max_host_bytes="auto"`` holds what fits and reads the rest from the files).
        revision: the Hub revision of a repo id.
        compress: ``"lossless"``: the weights kept coded in host memory (see :func:`offload`);
            under ``max_host_bytes`` the units in host memory are kept coded (more fit) and
            the others read from the files as they are (coded where ``shuttle compress``
            wrote them).

    Returns:
        ``(model, handle)``: ``model(...)`` and ``model.generate(...)`` work as for a model
        loaded with ``from_pretrained``; :meth:`OffloadHandle.remove` leaves it on ``meta``.

    Raises:
        MissingDependencyError: transformers (or huggingface_hub, for a repo id) is missing.
        AdapterFileError: no such folder or repo, no config, or no safetensors weights.
        CheckpointMismatchError: file tensors the model lacks (beyond those transformers
            ignores for it) or of another shape.
        MissingParameterError: a parameter that no file holds (tied ones are found under
            either name).
        OffloadError: no ``model_cls`` and no architecture in the config.
        InvalidOptionError: a ``torch_dtype`` that is not a floating-point dtype or its name.
        HostMemoryError: no ceiling given and the weights (at their stored dtypes) exceed
            the host memory available less 2 GiB; or ``"auto"`` with nothing to give.
        Whatever :func:`offload` raises (budgets, devices).
    """
    import_optional("transformers", "shuttle.integrations.transformers",
                    "pip install transformers")
    target = check_device(device)  # every argument checked before anything is read or built
    vram_budget, max_host_bytes = byte_budgets(vram_budget, max_host_bytes, target)
    torch_dtype = weights_dtype(torch_dtype)
    folder = local_folder(path_or_repo, revision, _MODEL_FILES)
    model, sources = empty_model(folder, model_cls, torch_dtype)
    max_host_bytes = files_ceiling(max_host_bytes, cache, [model], compress,
                                   "transformers.from_pretrained")
    handle = offload(model, max_host_bytes, cache=cache, vram_budget=vram_budget, device=device,
                     prefetch=prefetch, blocks=blocks, host=host, sources=sources,
                     compress=compress)
    return model, handle


def empty_model(folder: Path, model_cls: type | None, torch_dtype: torch.dtype | None,
                file: str | os.PathLike[str] | None = None) -> tuple[Any, dict[str, LazyTensor]]:
    """A transformers model of ``folder``'s config on ``meta``, and its file tensors (those of
    the folder's weights, or of ``file``).

    As transformers' ``from_pretrained`` builds it: the dtype (see :func:`from_pretrained`),
    float32 modules, tied weights, the generation config, ``eval()`` mode; checkpoint keys
    with or without the base model's prefix (a ``LlamaModel``'s files for a
    ``LlamaForCausalLM``).

    Raises:
        See :func:`from_pretrained`.
    """
    transformers = import_optional("transformers", "shuttle.integrations.transformers",
                                   "pip install transformers")
    if not (folder / "config.json").is_file():
        raise AdapterFileError(f"{folder}: no config.json; pass a folder written by a "
                               "transformers model's save_pretrained")
    config = transformers.AutoConfig.from_pretrained(folder)
    cls = _model_class(transformers, config, model_cls, folder)
    tensors = folder_tensors(folder) if file is None else file_tensors(file)
    dtype = torch_dtype or _config_dtype(config) or read_dtype(tensors)
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    with meta_parameters():
        model = cls._from_config(config, **{key: dtype})  # tied as its config says
    model.eval()
    prefix = getattr(model, "base_model_prefix", "")
    ignore = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    ignore |= {r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"}  # buffers that used to be saved
    fp32 = [*(getattr(model, "_keep_in_fp32_modules", None) or ()
              if dtype == torch.float16 else ()),
            *(getattr(model, "_keep_in_fp32_modules_strict", None) or ()
              if dtype in (torch.float16, torch.bfloat16) else ())]
    patterns = [re.compile(p.replace("*", ".*")) for p in fp32]  # as transformers matches them
    sources = match_sources(
        model, tensors, str(folder if file is None else file), ignore=ignore,
        names=lambda k: (k, f"{prefix}.{k}", k.removeprefix(f"{prefix}.")) if prefix else (k,),
        float32=lambda n: any(p.search(n) for p in patterns))
    if (folder / "generation_config.json").is_file() and model.can_generate():
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    model.config.name_or_path = str(folder)
    return model, sources


def _model_class(transformers: Any, config: Any, model_cls: type | None, folder: Path) -> type:
    if model_cls is None:
        names = getattr(config, "architectures", None) or []
        model_cls = getattr(transformers, names[0], None) if names else None
        if model_cls is None:
            raise OffloadError(f"{folder}: its config names no architecture transformers has "
                               f"({names}); pass model_cls= (e.g. AutoModelForCausalLM)")
    if not issubclass(model_cls, transformers.PreTrainedModel):  # an auto class
        try:
            model_cls = model_cls._model_mapping[type(config)]
        except (AttributeError, KeyError):
            raise OffloadError(f"model_cls={model_cls.__name__} builds no model of "
                               f"{type(config).__name__}; pass the model's class") from None
    return model_cls


def _config_dtype(config: Any) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None
