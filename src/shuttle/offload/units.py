"""Which parts of a model are units (:func:`units_of`): the block lists that stream (each a
group; blocks of one group may differ), the layers of layer mode, and the trainable parameters
kept on the device; every choice checked before anything is captured.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shuttle.errors import (
    BlockPathError,
    OffloadError,
)
from shuttle.weights.dtensor import is_dtensor

__all__ = ["units_of"]


def units_of(model: torch.nn.Module, blocks: str | Sequence[str],
              layers: bool | Sequence[type[torch.nn.Module]], trainable: str
              ) -> tuple[dict[str, list[torch.nn.Module]], dict[str, torch.nn.Module],
                         list[torch.nn.Parameter]]:
    """The block groups, layers and device-kept parameters of ``model``, checked (see
    :meth:`ModelOffloader.from_module`); changes nothing.
    """
    _check_sharding(model)
    on_device = _trainable(model) if trainable == "device" else []
    sharded = [n for n, p in model.named_parameters() if p.requires_grad and is_dtensor(p)]
    if on_device and sharded:
        raise OffloadError(
            f"trainable='device' with trainable DTensor parameters ({sharded[:3]}): "
            "moving a shard between devices is not supported; freeze them or train them "
            "resident")
    paths = [blocks] if isinstance(blocks, str) else list(blocks)
    groups = {p: _block_list(model, p) for p in paths}
    if len(groups) != len(paths):
        raise BlockPathError(f"blocks={paths}: a path is listed twice")
    _check_disjoint(groups)
    chosen = _layer_list(model, groups, layers, {id(p) for p in on_device})
    return groups, chosen, on_device


def _block_list(model: torch.nn.Module, path: str) -> list[torch.nn.Module]:
    lists = [n for n, m in model.named_modules()
             if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m)]
    try:
        container = model.get_submodule(path)
    except AttributeError:
        raise BlockPathError(f"blocks path {path!r} names no submodule of "
                             f"{type(model).__name__}; block lists in this model: "
                             f"{lists[:8]}") from None
    if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)) or not len(container):
        raise BlockPathError(f"blocks path {path!r} is a {type(container).__name__}, not a "
                             f"non-empty nn.ModuleList/nn.Sequential; block lists in this model: "
                             f"{lists[:8]}")
    return list(container)


def _check_disjoint(groups: dict[str, list[torch.nn.Module]]) -> None:
    owner: dict[int, str] = {}
    for path, blocks in groups.items():
        for i, block in enumerate(blocks):
            for m in block.modules():
                other = owner.setdefault(id(m), f"{path}.{i}")
                if other != f"{path}.{i}":
                    raise BlockPathError(f"block {path}.{i} overlaps {other} (a module in both); "
                                         "list block paths that do not nest or share modules")


def _check_sharding(model: torch.nn.Module) -> None:
    """Refuse a model under FSDP2 (``fully_shard``): it owns its shards' storage (its
    all-gathers read its own buffers), so re-pointing a parameter would not move what it reads.

    Raises:
        OffloadError: a module of ``model`` is an ``FSDPModule``.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            raise OffloadError(
                f"{name or 'the model'} is sharded by FSDP2 (fully_shard), which manages its "
                "shards' storage itself: offload with fully_shard(..., "
                "offload_policy=CPUOffloadPolicy()), or offload before sharding. Tensor-"
                "parallel DTensors (parallelize_module) stream as their local shards.")


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters with ``requires_grad``, each once."""
    seen: dict[int, torch.nn.Parameter] = {}
    for p in model.parameters():
        if p.requires_grad:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _layer_list(model: torch.nn.Module, groups: dict[str, list[torch.nn.Module]],
                layers: bool | Sequence[type[torch.nn.Module]],
                skip: set[int] | None = None) -> dict[str, torch.nn.Module]:
    """Module path -> layer: leaf modules outside the blocks with untied parameters (those
    whose parameters are all in ``skip``, kept on the device, are none).
    """
    if layers is False:
        return {}
    kinds: tuple[type, ...] = ()
    if layers is not True:
        kinds = tuple(layers) if isinstance(layers, Sequence) else ()
        if not kinds or not all(isinstance(k, type) and issubclass(k, torch.nn.Module)
                                for k in kinds):
            raise OffloadError(f"layers={layers!r}: expected True, False or a sequence of "
                               "nn.Module classes, e.g. (nn.Linear, nn.Conv2d)")
    in_blocks = {id(m) for blocks in groups.values() for b in blocks for m in b.modules()}
    owners: dict[int, int] = {}  # parameter id -> how many modules register it
    for m in model.modules():
        for p in {id(p) for p in m._parameters.values() if p is not None}:
            owners[p] = owners.get(p, 0) + 1
    out = {}
    for path, m in model.named_modules():
        own = [p for p in m._parameters.values() if p is not None and id(p) not in (skip or ())]
        if (not own or not path or id(m) in in_blocks or next(m.children(), None) is not None
                or (kinds and not isinstance(m, kinds)) or any(owners[id(p)] > 1 for p in own)):
            continue
        out[path] = m
    if not out:
        raise OffloadError(f"layers={layers!r} selects no module of {type(model).__name__}: "
                           "layers are leaf modules outside the blocks with parameters of their "
                           "own, not tied to another module's")
    return out
