"""Rows of a patch's update: one adapter module split across several model modules.

``select_rows(patch, start, end)`` is the patch whose update is rows ``start:end`` of
``patch``'s update. Nothing is read: a :class:`RowSlice` stands for the rows of a lazy tensor.
"""

from __future__ import annotations

import dataclasses

import torch

from shuttle.errors import UnsupportedFormatError
from shuttle.patches.dense import Diff, Set
from shuttle.patches.dora import DoRA
from shuttle.patches.lowrank import LowRank
from shuttle.patches.patch import Patch, Tensorish, materialize

__all__ = ["RowSlice", "select_rows"]


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


def _rows(t: Tensorish, start: int, end: int) -> Tensorish:
    return t[start:end] if isinstance(t, torch.Tensor) else RowSlice(t, start, end)


def select_rows(patch: Patch, start: int, end: int) -> Patch:
    """The patch updating rows ``start:end`` of what ``patch`` updates.

    Raises:
        UnsupportedFormatError: the kind cannot be split by rows (LoHa, LoKr, (IA)3, transposed
            factors, column-wise DoRA).
    """
    if isinstance(patch, LowRank) and not patch.transposed:
        # A kohya Flux split-qkv save is recognized from the whole up factor's zeros.
        source = patch.scale_source if patch.scale_source is not None else patch.up
        return dataclasses.replace(patch, up=_rows(patch.up, start, end),
                                   scale_source=source if patch.split_qkv else None)
    if isinstance(patch, Diff) and len(patch.diff.shape):
        return dataclasses.replace(patch, diff=_rows(patch.diff, start, end))
    if isinstance(patch, Set) and len(patch.value.shape):
        return dataclasses.replace(patch, value=_rows(patch.value, start, end))
    if isinstance(patch, DoRA) and patch.magnitude.shape[0] == patch.out_rows:
        return dataclasses.replace(patch, magnitude=_rows(patch.magnitude, start, end),
                                   inner=select_rows(patch.inner, start, end))
    raise UnsupportedFormatError(
        f"a {patch.kind} patch cannot be split by rows across several layers; merge it into a "
        "model with the adapter's own layout, or pass mapping= to place it whole"
    )
