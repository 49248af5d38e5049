"""Columns of a patch's update: the input-column shard of a weight (a column-sharded DTensor).

``select_columns(patch, start, end, columns)`` is the patch whose update is ``[:, start:end]``
of ``patch``'s update, for a parameter of ``columns`` columns (dimension 1: the input features
of a Linear, the input channels of a convolution). Nothing is read. A low-rank patch is cut in
its ``down`` factor (``up @ down[:, start:end]``: exact, the rank work shrinks with the shard);
a dense ``diff`` or a ``set`` value in its columns; any other additive kind is wrapped in
:class:`ColumnsOf`, whose update is columns of the whole float32 update. A kind whose update
needs the whole weight (DoRA's column norms, (IA)3 scaling input columns by the whole row)
cannot be cut: :meth:`ColumnsOf.check` refuses it before anything changes.
"""

from __future__ import annotations

import dataclasses

import torch

from shuttle.errors import ShapeMismatchError, UnsupportedLayerError
from shuttle.patches.dense import Diff, Set
from shuttle.patches.lowrank import LowRank
from shuttle.patches.patch import Patch, Tensorish, materialize
from shuttle.patches.replace import Replace
from shuttle.patches.select_rows import PartOf

__all__ = ["ColumnSlice", "ColumnsOf", "select_columns"]


class ColumnSlice:
    """Columns ``start:end`` (dimension 1) of a tensor or lazy tensor, read on :meth:`load`."""

    def __init__(self, base: Tensorish, start: int, end: int):
        self.base, self.start, self.end = base, start, end

    @property
    def shape(self) -> torch.Size:
        s = self.base.shape
        return torch.Size((s[0], self.end - self.start, *s[2:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def load(self) -> torch.Tensor:
        return materialize(self.base)[:, self.start:self.end]


def _columns(t: Tensorish, start: int, end: int) -> Tensorish:
    return t[:, start:end] if isinstance(t, torch.Tensor) else ColumnSlice(t, start, end)


@dataclasses.dataclass(frozen=True, eq=False)
class ColumnsOf(PartOf):
    """Columns ``start:end`` of ``inner``'s whole update (a parameter of ``columns`` columns).

    Attributes:
        columns: the whole parameter's columns.
    """

    columns: int = 0

    @property
    def out_rows(self) -> int | None:
        return self.inner.out_rows

    def _whole(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0], self.columns, *shape[2:])

    def check(self, shape: torch.Size | tuple[int, ...], name: str) -> None:
        shape = tuple(shape)
        if not self.inner.additive:
            raise UnsupportedLayerError(
                f"{name!r} is sharded by input columns, and its {self.inner.kind} patch's "
                "update depends on whole rows of the weight (DoRA's norms, (IA)3's scales), "
                "which no shard holds: merge it into the weight before sharding, or shard the "
                "weight by rows (Shard(0)) or replicate it")
        if len(shape) < 2 or shape[1] != self.end - self.start:
            raise ShapeMismatchError(f"{name!r}: a column shard {self.start}:{self.end} of a "
                                     f"{self.inner.kind} patch for a parameter of shape "
                                     f"{shape}")
        self.inner.check(self._whole(shape), name)

    def delta(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        whole = self.inner.delta(self._whole(tuple(shape)))
        return whole[:, self.start:self.end]


def select_columns(patch: Patch, start: int, end: int, columns: int) -> Patch:
    """The patch updating columns ``start:end`` of what ``patch`` updates (a parameter of
    ``columns`` columns). Never raises: a kind that cannot be cut is refused by validation.
    """
    if isinstance(patch, LowRank) and not patch.transposed and patch.mid is None \
            and len(patch.down.shape) >= 2 and patch.down.shape[1] == columns:
        return dataclasses.replace(patch, down=_columns(patch.down, start, end))
    if isinstance(patch, Diff) and len(patch.diff.shape) >= 2:
        return dataclasses.replace(patch, diff=_columns(patch.diff, start, end))
    if isinstance(patch, (Set, Replace)) and len(patch.value.shape) >= 2:
        return dataclasses.replace(patch, value=_columns(patch.value, start, end))
    return ColumnsOf(patch.param, inner=patch, start=start, end=end, columns=columns)
