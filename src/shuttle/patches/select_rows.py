"""Rows of a patch's update: one adapter module split across several model modules.

``select_rows(patch, start, end)`` is the patch whose update is rows ``start:end`` of
``patch``'s update. Nothing is read. Kinds whose rows have factors of their own are cut there
(a low-rank ``up``, a dense ``diff``, a DoRA magnitude per output row, (IA)3 row scales), the
cheap and exact way. Any other kind is wrapped in :class:`RowsOf`, whose update is rows of the
whole float32 update: a LoKr's Kronecker product or a LoHa's Hadamard product has no factor
that holds a row range (a kron row block spans rows of both factors), but its whole update is
known without the weight, so the rows are exact. A kind whose update needs the whole weight (a
DoRA normalizing input columns over all rows) cannot be cut; :meth:`RowsOf.check` refuses it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import TypeVar

import torch

from shuttle.errors import ShapeMismatchError, UnsupportedLayerError
from shuttle.patches.dense import Diff, Set
from shuttle.patches.dora import DoRA
from shuttle.patches.ia3 import IA3
from shuttle.patches.lowrank import LowRank
from shuttle.patches.patch import Patch, Tensorish, materialize
from shuttle.patches.replace import Replace

__all__ = ["PartOf", "RowSlice", "RowsOf", "select_rows"]


class RowSlice:
    """Rows ``start:end`` (first dimension) of a tensor or lazy tensor, read on :meth:`load`."""

    def __init__(self, base: Tensorish, start: int, end: int):
        self.base, self.start, self.end = base, start, end

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.end - self.start, *self.base.shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def load(self) -> torch.Tensor:
        return materialize(self.base)[self.start:self.end]


_P = TypeVar("_P", bound="PartOf")


@dataclasses.dataclass(frozen=True, eq=False)
class PartOf(Patch):
    """A window of ``inner``'s whole update (rows: :class:`RowsOf`; columns:
    ``select_columns.ColumnsOf``): the kind, tensors and rank are the inner patch's.

    Attributes:
        inner: the patch of the whole parameter.
        start, end: the window along the dimension the subclass cuts.
    """

    inner: Patch = None  # type: ignore[assignment]
    start: int = 0
    end: int = 0

    @property  # type: ignore[override]
    def kind(self) -> str:  # messages name the kind the file holds
        return self.inner.kind

    def tensors(self) -> Iterator[tuple[str, Tensorish]]:
        for name, t in self.inner.tensors():
            yield f"inner.{name}", t

    def load(self: _P, device: torch.device | str | None = None) -> _P:
        inner = self.inner.load(device)
        return self if inner is self.inner else dataclasses.replace(self, inner=inner)

    @property
    def rank(self) -> int | None:
        return self.inner.rank


@dataclasses.dataclass(frozen=True, eq=False)
class RowsOf(PartOf):
    """Rows ``start:end`` of ``inner``'s whole update, for a patch made for a fused layer.

    The update is ``inner.delta((inner.out_rows, *shape[1:]))[start:end]``: the whole update in
    float32, once per target (each split layer forms it again; no state is kept between them).
    Being additive, it merges, runs dynamically (as the dense weight residual every kind without
    a low-rank forward uses) and lands during a streamed load like the inner kind would.
    """

    @property
    def alpha(self) -> float | None:
        return self.inner.alpha

    @property
    def out_rows(self) -> int:
        return self.end - self.start

    def check(self, shape: torch.Size | tuple[int, ...], name: str) -> None:
        shape = tuple(shape)
        full = self.inner.out_rows
        where = f"{name!r} gets rows {self.start}:{self.end} of a {self.inner.kind} patch " \
                "made for a fused layer"
        if not self.inner.additive or full is None:
            why = ("its update depends on the whole fused weight (a DoRA magnitude per input "
                   "column normalizes each column over the rows of every split layer)"
                   if isinstance(self.inner, DoRA) else
                   f"rows of its tensors {self.inner.shapes()} cannot be cut apart")
            raise UnsupportedLayerError(
                f"{where}, but {why}. Load the model in the adapter's fused layout (FLUX.1: "
                "BFL's own checkpoint names), or leave this module out of the adapter."
            )
        if not shape or shape[0] != self.end - self.start or self.end > full:
            raise ShapeMismatchError(
                f"{where} with {full} rows, but the parameter has shape {shape}. The adapter "
                "was made for a different model; load it into the model it was trained for."
            )
        self.inner.check((full, *shape[1:]), name)

    def delta(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        whole = self.inner.delta((self.inner.out_rows, *tuple(shape)[1:]))
        return whole[self.start:self.end]


def _rows(t: Tensorish, start: int, end: int) -> Tensorish:
    return t[start:end] if isinstance(t, torch.Tensor) else RowSlice(t, start, end)


def select_rows(patch: Patch, start: int, end: int) -> Patch:
    """The patch updating rows ``start:end`` of what ``patch`` updates.

    Never raises: a kind that cannot be cut exactly (a DoRA with input-column norms) becomes a
    :class:`RowsOf` that validation refuses, naming the parameter, before any weight changes.
    """
    if isinstance(patch, LowRank) and not patch.transposed:
        # A kohya Flux split-qkv save is recognized from the whole up factor's zeros.
        source = patch.scale_source if patch.scale_source is not None else patch.up
        return dataclasses.replace(patch, up=_rows(patch.up, start, end),
                                   scale_source=source if patch.split_qkv else None)
    if isinstance(patch, Diff) and len(patch.diff.shape):
        return dataclasses.replace(patch, diff=_rows(patch.diff, start, end))
    if isinstance(patch, (Set, Replace)) and len(patch.value.shape):
        return dataclasses.replace(patch, value=_rows(patch.value, start, end))
    if isinstance(patch, DoRA) and patch.magnitude.shape[0] == patch.out_rows:
        # Norms per output row: each row's norm reads that row only, so the rows split exactly.
        return dataclasses.replace(patch, magnitude=_rows(patch.magnitude, start, end),
                                   inner=select_rows(patch.inner, start, end))
    if isinstance(patch, IA3):
        if patch.on_input:  # the same column scales on every row
            return patch
        if patch.weight.shape[0] == math.prod(patch.weight.shape):  # (out,) or (out, 1)
            return dataclasses.replace(patch, weight=_rows(patch.weight, start, end))
    return RowsOf(patch.param, inner=patch, start=start, end=end)
