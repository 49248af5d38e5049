"""A component's weights from an original single-file checkpoint, placed by the family tables.

Original checkpoints (Black Forest Labs' ``flux1-dev.safetensors``, a ComfyUI-style file with
``model.diffusion_model.`` keys, ...) name and fuse weights their own way; the family tables of
:mod:`shuttle.targets` (``FAMILY_MAPS``: Flux, SD3, Wan, HunyuanVideo, LTX-Video, Lumina 2,
Chroma, CogVideoX, the SD UNet) say where each original module lives in the diffusers model,
both ways, for adapters. The same tables place a checkpoint: a file tensor goes whole to one
model tensor, or its rows are cut over several (BFL's fused ``qkv`` onto ``to_q``/``to_k``/
``to_v``, rows swapped where the two layouts order halves differently), or several file
tensors fill the rows of one fused model tensor.

Each model tensor assembled from rows is a :class:`RowPieces`: the file tensors' row ranges it
is made of, read straight into the model tensor's bytes (``pread`` of each range into its
place: still one read of each byte, no other copy). Its rows must be covered exactly once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import NamedTuple

import torch

from shuttle.errors import CheckpointMismatchError
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.targets import FAMILY_MAPS, ModelNames, Split, fused_modules

__all__ = ["RowPieces", "place_original"]

Rows = tuple[int, int]
_CHECKPOINT_PREFIXES = ("model.diffusion_model.",)


class _Piece(NamedTuple):
    src: LazyTensor
    source_rows: Rows  # rows of the file tensor
    rows: Rows  # rows of the model tensor they fill


class RowPieces:
    """A model tensor made of row ranges of file tensors (reads like a :class:`LazyTensor`).

    Args:
        key: the model tensor's name (for messages).
        shape: the model tensor's shape.
        pieces: ``(file tensor, its rows, the model tensor's rows)``, covering each row once.
    """

    __slots__ = ("dtype", "key", "pieces", "shape")

    def __init__(self, key: str, shape: torch.Size, pieces: list[_Piece]):
        self.key = key
        self.shape = torch.Size(shape)
        self.pieces = sorted(pieces, key=lambda p: p.rows)
        self.dtype = self.pieces[0].src.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def load_into(self, out: torch.Tensor) -> torch.Tensor:
        """Read every piece into its rows of the CPU ``uint8`` buffer ``out``; returns the typed
        view of ``out``.
        """
        row = self.nbytes // self.shape[0]
        for p in self.pieces:
            p.src.load_rows(*p.source_rows, out=out[p.rows[0] * row:p.rows[1] * row])
        return out[:self.nbytes].view(self.dtype).view(self.shape)

    def load(self, *, copy: bool = False) -> torch.Tensor:
        """The whole tensor, in memory of its own."""
        return self.load_into(torch.empty(self.nbytes, dtype=torch.uint8))

    def load_converted(self, out: torch.Tensor) -> torch.Tensor:
        """Read the tensor into ``out`` (of its shape), converted to ``out``'s dtype piece by
        piece (see :meth:`LazyTensor.load_converted`).
        """
        for p in self.pieces:
            p.src.load_converted(out[p.rows[0]:p.rows[1]], p.source_rows)
        return out

    def __repr__(self) -> str:
        return f"RowPieces({self.key!r}, {tuple(self.shape)}, {len(self.pieces)} pieces)"


def place_original(model: torch.nn.Module, tensors: Mapping[str, LazyTensor], where: str
                   ) -> dict[str, LazyTensor | RowPieces]:
    """The file tensors of ``tensors`` under the names of ``model``'s tensors.

    A key the model has keeps its place; any other is looked up in the family tables
    (``module.leaf``: the module's place, the leaf renamed where a table says so); a key no
    table places is kept under its own name (for :func:`~shuttle.integrations.pretrained.
    match_sources` to report).

    Raises:
        CheckpointMismatchError: the rows placed on a model tensor do not cover it exactly once,
            or a piece's width is not the tensor's.
    """
    expected = model.state_dict(keep_vars=True)
    names = ModelNames({n: t.shape for n, t in expected.items()}, fused_modules(model))
    placed: dict[str, LazyTensor | RowPieces] = {}
    pieces: dict[str, list[_Piece]] = defaultdict(list)
    for key, src in tensors.items():
        module, _, leaf = key.rpartition(".")
        value = None if key in expected else next(
            (v for m in _unprefixed(module) for fn in FAMILY_MAPS
             if (v := fn(m, names)) is not None), None)
        if value is None:
            placed[key] = src
            continue
        for path, source_rows, rows, params in _splits(value):
            name = f"{path}.{dict(params).get(leaf, leaf)}"
            pieces[name].append(_Piece(src, source_rows or (0, _rows(src.shape)),
                                       rows or (0, _rows(expected[name].shape)
                                                if name in expected else 0)))
    _check_used(pieces, where)
    for name, ps in pieces.items():
        if name in placed:
            raise CheckpointMismatchError(f"{where}: {name!r} is in the file under its own "
                                          "name and also as parts of "
                                          f"{sorted({p.src.key for p in ps})}; keep one")
        (p, *more) = ps
        whole = (not more and name in expected
                 and tuple(p.src.shape) == tuple(expected[name].shape)
                 and p.source_rows == p.rows == (0, _rows(p.src.shape)))
        placed[name] = p.src if whole else _assembled(name, ps, expected, where)
    return placed


def _check_used(pieces: Mapping[str, list[_Piece]], where: str) -> None:
    """Every file tensor the tables cut is used whole, each of its rows once.

    Raises:
        CheckpointMismatchError: rows beyond the tensor, rows used twice or not at all (a
            checkpoint of another width than the config).
    """
    used: dict[str, list[Rows]] = defaultdict(list)
    shapes: dict[str, torch.Size] = {}
    for ps in pieces.values():
        for p in ps:
            used[p.src.key].append(p.source_rows)
            shapes[p.src.key] = p.src.shape
    for key, spans in used.items():
        at = 0
        for a, b in sorted(spans):
            if a != at:
                break
            at = b
        if at != _rows(shapes[key]) or len({a for a, _ in spans}) != len(spans):
            raise CheckpointMismatchError(
                f"{where}: {key!r} {tuple(shapes[key])} is cut into rows {sorted(spans)} by the "
                "family table, which do not cover it once: the checkpoint is for another "
                "config than the model's")


def _unprefixed(module: str) -> list[str]:
    """``module``, and without the prefix of a whole-model checkpoint (ComfyUI's files hold
    the denoiser under ``model.diffusion_model.``, beside the VAE and text encoders).
    """
    return [module] + [module[len(p):] for p in _CHECKPOINT_PREFIXES if module.startswith(p)]


def _rows(shape: torch.Size) -> int:
    return shape[0] if len(shape) else 1


def _splits(value) -> list[Split]:
    if isinstance(value, str):
        return [Split(value)]
    if isinstance(value, tuple):
        path, rows = value
        return [Split(path, None, rows)]
    return list(value)


def _assembled(name: str, ps: list[_Piece], expected: Mapping[str, torch.Tensor],
               where: str) -> RowPieces:
    if name not in expected:
        raise CheckpointMismatchError(f"{where}: the family table places {ps[0].src.key!r} on "
                                      f"{name!r}, which the model lacks; check the config")
    shape = expected[name].shape
    at = 0
    for p in sorted(ps, key=lambda p: p.rows):
        width = tuple(p.src.shape[1:])
        if p.rows[0] != at or p.rows[1] - p.rows[0] != p.source_rows[1] - p.source_rows[0] \
                or width != tuple(shape[1:]):
            raise CheckpointMismatchError(
                f"{where}: {name!r} {tuple(shape)} is not covered once by rows of "
                f"{sorted({q.src.key for q in ps})} (rows {[q.rows for q in ps]}, from "
                f"{[tuple(q.src.shape) for q in ps]}); the checkpoint is for another config")
        at = p.rows[1]
    if at != shape[0] or len({p.src.dtype for p in ps}) > 1:
        raise CheckpointMismatchError(
            f"{where}: {name!r} {tuple(shape)} is covered up to row {at} by "
            f"{sorted({q.src.key for q in ps})} (or from tensors of several dtypes)")
    return RowPieces(name, shape, ps)
