"""DTensor shards: a sharded parameter as one registered weight representation.

A ``DTensor`` parameter (FSDP2's ``fully_shard``, tensor parallelism, ``distribute_tensor``)
has a global shape and, on each rank, a local tensor: the whole tensor under ``Replicate``, or
a chunk of it along a dimension under ``Shard(d)``. Chunks follow ``torch.chunk``: ``n`` rows
on ``k`` ranks give chunks of ``ceil(n / k)`` rows, the last ones shorter or empty (13 rows on
2 ranks: 7 + 6). On a mesh of several dimensions the placements apply one mesh dimension after
another, so ``(Shard(0), Shard(0))`` chunks dimension 0 again within each chunk.

:class:`ShardedWeight` is the one place that knows a sharded parameter: its local shard, the
window ``[start, stop)`` of every global dimension that shard holds (:func:`shard_window`,
from the mesh coordinates alone, no communication), how a merge's update is cut to that
window (:meth:`~ShardedWeight.cut`: local rows and columns only), how a load reads and writes
it (:meth:`~ShardedWeight.read_rows`, :meth:`~ShardedWeight.write`), and what shuttle refuses
(:class:`~shuttle.errors.UnsupportedPlacementError`): ``Partial`` placements (pending
reductions) and strided shards (composed parallelisms) hold no window of the global tensor,
shards of dimensions past the columns take no adapter update. It is registered as the
``"dtensor"`` representation (:func:`~shuttle.weights.represent` finds it for any DTensor);
code that must branch asks :func:`sharded`, which gives it or None.

:func:`is_dtensor` is an ``isinstance`` check against ``torch.distributed.tensor.DTensor``
without importing that module: a DTensor can only exist once the module defining it has been
imported, so while it is absent from ``sys.modules`` nothing is one, and once there its class
is looked up once and kept.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from shuttle.errors import UnsupportedPlacementError
from shuttle.kernels.rounding import Rounding
from shuttle.patches import Patch
from shuttle.patches.select_columns import select_columns
from shuttle.patches.select_rows import select_rows
from shuttle.weights.plain import is_plain_tensor
from shuttle.weights.representation import WeightRepresentation, register_representation

__all__ = ["ShardWindow", "ShardedWeight", "bind_local", "is_dtensor", "local_tensor",
           "shard_window", "sharded"]

_DTENSOR: type | None = None  # torch.distributed.tensor.DTensor, once its module is imported


def _dtensor_class() -> type | None:
    global _DTENSOR
    if _DTENSOR is None:
        module = sys.modules.get("torch.distributed.tensor")
        # None while the module is absent (or still initializing): asked again next time
        _DTENSOR = getattr(module, "DTensor", None)
    return _DTENSOR


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (a subclass of it included).

    Imports nothing: without ``torch.distributed.tensor`` imported there is no DTensor.
    """
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def sharded(t: object, name: str = "the weight") -> ShardedWeight | None:
    """The :class:`ShardedWeight` of ``t`` when it is a DTensor, else None.

    Args:
        t: a parameter, buffer or any object.
        name: the parameter's name, for the errors the sharded weight raises.
    """
    return ShardedWeight.of(t, name) if is_dtensor(t) else None  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class ShardWindow:
    """The ``[starts[d], stops[d])`` range of each dimension ``d`` held locally."""

    starts: tuple[int, ...]
    stops: tuple[int, ...]

    def covers(self, dim: int, size: int) -> bool:
        """Whether dimension ``dim`` (of global ``size``) is held whole."""
        return self.starts[dim] == 0 and self.stops[dim] == size


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard DTensor ``t`` stores on this rank, as stored (not ``to_local()``'s autograd
    view): what an offloader copies and binds.
    """
    return t._local_tensor  # type: ignore[attr-defined]


def bind_local(t: torch.Tensor, shard: torch.Tensor) -> None:
    """Make ``shard`` the local tensor of DTensor ``t`` in place: the DTensor object (and a
    Parameter's identity), its placements, mesh and global shape stay.
    """
    t._local_tensor = shard  # type: ignore[attr-defined]


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


@register_representation("dtensor")
@dataclasses.dataclass
class ShardedWeight(WeightRepresentation):
    """A DTensor parameter as this rank holds it: its local shard of the global weight.

    The local tensor is the one declared tensor (what this rank stores: ``nbytes``, ``pin``,
    ``to`` act on it); the logical shape is the global one. The global weight is never
    dequantized or re-encoded on one rank: a merge goes into the local tensor, with the
    update cut to the window (:meth:`cut`), and that local tensor has its own representation.

    Attributes:
        local: this rank's local tensor (``param.to_local()``).
        param: the DTensor (global shape, mesh, placements).
        name: the parameter's name, for error messages.
    """

    local: torch.Tensor
    param: torch.Tensor
    name: str = "the weight"

    tensor_names = ("local",)
    mergeable = False  # not as a whole: each rank merges its window into ``local``

    @classmethod
    def of(cls, t: torch.Tensor, name: str = "the weight") -> ShardedWeight:
        """``t`` (a DTensor) as a sharded weight named ``name``."""
        return cls(t.to_local(), t, name)  # type: ignore[attr-defined]

    @classmethod
    def accepts(cls, tensor: torch.Tensor) -> bool:
        return is_dtensor(tensor)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> ShardedWeight:
        return cls.of(tensor)

    # -- where the shard lies ----------------------------------------------------------------

    @property
    def logical_shape(self) -> torch.Size:
        """The global shape."""
        return self.param.shape

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param.dtype

    @functools.cached_property
    def window(self) -> ShardWindow:
        """The window of the global tensor the local tensor holds (see :func:`shard_window`).

        Raises:
            UnsupportedPlacementError: a placement or layout without a window.
        """
        return shard_window(self.param, self.name)

    @property
    def sharded_dims(self) -> list[int]:
        """The global dimensions this rank holds part of (not whole)."""
        shape = self.param.shape
        return [d for d in range(len(shape)) if not self.window.covers(d, shape[d])]

    @property
    def device_type(self) -> str:
        """The device type of the mesh (where collectives over it run)."""
        return self.param.device_mesh.device_type  # type: ignore[attr-defined]

    def versions(self) -> tuple[int, int]:
        """The version counters a write into this parameter bumps: the DTensor's, and its
        local tensor's (a write into the shard bypasses the DTensor's own).
        """
        return self.param._version, self.local._version

    # -- merges ------------------------------------------------------------------------------

    def check_merge(self, rounding: Rounding | str | None, *, widened: bool = False) -> None:
        """Refuse a merge into this shard that shuttle cannot do window by window.

        Args:
            rounding: the merge's rounding (None: the dtype's default).
            widened: whether the merge widens the parameter (a control LoRA's input layer).

        Raises:
            UnsupportedPlacementError: a placement without a window, a widening, a shard of a
                dimension past the columns, or stochastic rounding into a sharded encoded
                (non-plain) local tensor.
        """
        _ = self.window  # a placement without a window is refused first
        if widened:
            raise UnsupportedPlacementError(
                f"parameter {self.name!r} is a DTensor the adapter widens (a control LoRA's "
                "img_in): widen and merge before sharding")
        cut = self.sharded_dims
        if any(d > 1 for d in cut):
            raise UnsupportedPlacementError(
                f"parameter {self.name!r} is sharded along dimension(s) "
                f"{[d for d in cut if d > 1]} (placements {tuple(self.param.placements)}): "
                "adapters land on row (Shard(0)) and column (Shard(1)) shards only")
        if cut and not is_plain_tensor(self.local) and rounding not in ("nearest",):
            raise UnsupportedPlacementError(
                f"parameter {self.name!r} is a sharded {type(self.local).__qualname__} weight "
                "(an encoding by blocks or scales that the shard boundary cuts): stochastic "
                "rounding (its default) would depend on the world size; pass "
                "rounding='nearest', or replicate it")

    def cut(self, patch: Patch, rows: tuple[int, int] | None
            ) -> tuple[Patch, tuple[int, int] | None] | None:
        """The part of an update that lands in this shard, in local coordinates.

        For a window of rows ``[R0, R1)`` and columns ``[C0, C1)``, an update of global rows
        ``[a, b)`` keeps its rows in ``[max(a, R0), min(b, R1))`` and, for a column shard,
        columns ``[C0, C1)``: the local merge then computes exactly the window of the global
        update, ``W_local + s * up[R0:R1] @ down[:, C0:C1]`` for a low-rank one.

        Args:
            patch: an update of rows ``rows`` of the global weight.
            rows: its global ``[start, stop)`` rows; None: every row.

        Returns:
            ``(patch cut to the window, its local rows)`` (local rows None: every local row),
            or None when the update has no row in this shard.
        """
        shape = tuple(self.param.shape)
        window = self.window
        r0, r1 = window.starts[0], window.stops[0]
        a, b = rows or (0, shape[0])
        lo, hi = max(a, r0), min(b, r1)
        if lo >= hi:
            return None
        if (lo, hi) != (a, b):
            patch = select_rows(patch, lo - a, hi - a)
        local = None if (lo - r0, hi - r0) == (0, r1 - r0) else (lo - r0, hi - r0)
        if len(shape) > 1 and not window.covers(1, shape[1]):
            patch = select_columns(patch, window.starts[1], window.stops[1], shape[1])
        return patch, local

    def dequantize(self) -> torch.Tensor:
        raise UnsupportedPlacementError(
            f"{self.name!r} is a DTensor: this rank holds only the window {self.window} of it; "
            "dequantize its local shard (ShardedWeight.local), or gather it (full_tensor())")

    def encode(self, x: torch.Tensor, rounding: Rounding = "nearest",
               generator: torch.Generator | None = None) -> ShardedWeight:
        raise UnsupportedPlacementError(
            f"{self.name!r} is a DTensor: a merge writes each rank's window into its local "
            "shard (ShardedWeight.cut), never the global weight")

    # -- loads -------------------------------------------------------------------------------

    def check_load(self) -> None:
        """Refuse a shard that a checkpoint load cannot write in place.

        Raises:
            UnsupportedPlacementError: the DTensor is on the meta device, or has a placement
                or layout without a window.
        """
        if self.param.is_meta:
            raise UnsupportedPlacementError(
                f"{self.name!r} is a DTensor on the meta device: shard the model (fully_shard, "
                "parallelize_module), then materialize it (model.to_empty(device=...)) before "
                "load_checkpoint, which writes each rank's shard in place (FSDP2 and tensor "
                "parallelism keep references to the parameters they sharded)")
        _ = self.window  # a placement without a window: refused here

    def read_rows(self) -> tuple[int, int] | None:
        """The global rows ``[R0, R1)`` this shard holds, where it holds part of the rows (so
        a load reads those rows alone); None where it holds every row (read whole).
        """
        shape = self.param.shape
        if not shape or self.window.covers(0, shape[0]):
            return None
        return self.window.starts[0], self.window.stops[0]

    def write(self, t: torch.Tensor, row0: int = 0) -> None:
        """Copy this shard's window of ``t`` into the local tensor, in place.

        Args:
            t: the global tensor, or its rows from ``row0`` on (those of :meth:`read_rows`).
            row0: the global row ``t``'s first row is.
        """
        cut = [slice(a, b) for a, b in zip(self.window.starts, self.window.stops, strict=True)]
        if cut:
            cut[0] = slice(cut[0].start - row0, cut[0].stop - row0)
        self.local.copy_(t[tuple(cut)])
