"""DTensor shards: which window of a parameter's global tensor this rank holds.

A ``DTensor`` parameter (FSDP2's ``fully_shard``, tensor parallelism, ``distribute_tensor``)
has a global shape and, on each rank, a local tensor: the whole tensor under ``Replicate``, or
a chunk of it along a dimension under ``Shard(d)``. Chunks follow ``torch.chunk``: ``n`` rows
on ``k`` ranks give chunks of ``ceil(n / k)`` rows, the last ones shorter or empty (13 rows on
2 ranks: 7 + 6). On a mesh of several dimensions the placements apply one mesh dimension after
another, so ``(Shard(0), Shard(0))`` chunks dimension 0 again within each chunk.

:func:`shard_window` gives the ``[start, stop)`` range of every tensor dimension that the local
tensor holds, computed from the mesh coordinates alone (no communication), and checks it
against the local tensor's shape. ``Partial`` placements (pending reductions) and strided
shards (from composed parallelisms) hold no window of the global tensor: they are refused.
"""

from __future__ import annotations

import dataclasses

import torch

from shuttle.errors import UnsupportedPlacementError

__all__ = ["ShardWindow", "is_dtensor", "shard_window"]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it when
    torch.distributed is absent).
    """
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


@dataclasses.dataclass(frozen=True)
class ShardWindow:
    """The ``[starts[d], stops[d])`` range of each dimension ``d`` held locally."""

    starts: tuple[int, ...]
    stops: tuple[int, ...]

    def covers(self, dim: int, size: int) -> bool:
        """Whether dimension ``dim`` (of global ``size``) is held whole."""
        return self.starts[dim] == 0 and self.stops[dim] == size


def shard_window(t: torch.Tensor, name: str) -> ShardWindow:
    """The window of ``t``'s global tensor (a DTensor) that this rank's local tensor holds.

    Raises:
        UnsupportedPlacementError: a ``Partial`` or strided placement, or a local tensor whose
            shape is not the computed window's (a layout shuttle does not know).
    """
    from torch.distributed.tensor import Replicate, Shard

    shape = tuple(t.shape)
    starts, stops = [0] * len(shape), list(shape)
    mesh = t.device_mesh
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:  # Partial, _StridedShard, anything newer
            raise UnsupportedPlacementError(
                f"parameter {name!r} has placement {placement} on mesh dimension {mesh_dim}: "
                "shuttle applies adapters to Replicate and Shard(d) placements only (a Partial "
                "tensor holds no part of the weight until reduced; a strided shard comes from "
                "composed parallelisms). Redistribute it to Shard or Replicate first.")
        d = placement.dim % len(shape)
        k = mesh.size(mesh_dim)
        i = mesh.get_local_rank(mesh_dim)
        n = stops[d] - starts[d]
        chunk = -(-n // k) if n else 0
        lo = min(starts[d] + i * chunk, stops[d])
        starts[d], stops[d] = lo, min(lo + chunk, stops[d])
    window = ShardWindow(tuple(starts), tuple(stops))
    local = tuple(b - a for a, b in zip(starts, stops, strict=True))
    if local != tuple(t.to_local().shape):
        raise UnsupportedPlacementError(
            f"parameter {name!r}: its local tensor has shape {tuple(t.to_local().shape)}, "
            f"but placements {tuple(t.placements)} on mesh {tuple(mesh.shape)} give {local} "
            "(an uneven layout other than torch.chunk's); shuttle cannot locate its shard")
    return window
