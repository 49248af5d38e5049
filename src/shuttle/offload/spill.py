"""The disk tier's view of a unit (a host ceiling, ``max_host_bytes``): whether it can be read
again from its files whenever needed, where its bytes lie there, what its arena takes, and the
smallest host memory a storage needs (the units that must stay, plus one staging buffer).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shuttle.formats.safetensors_file import LazyTensor
from shuttle.offload.arena import PAGE, new_arena
from shuttle.offload.coded import UnitCode, file_code
from shuttle.offload.disk_reader import IO_ALIGN, DiskSpans
from shuttle.offload.layout import Layout
from shuttle.offload.survey import UnitSurvey, read_entry
from shuttle.weights.lossless_file import CodedRef

__all__ = ["MIN_STAGING", "HostNeeds", "arena_size", "convert_hint", "converted_bytes",
           "disk_spans", "fill_sides", "held_bytes", "host_floor", "on_disk_views", "side_entries",
           "side_layout", "side_size", "spillable", "staging_floor"]

MIN_STAGING = 16 * 2**20  # the smallest staging buffer a plan uses (smaller: chunks too small)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def staging_floor(largest: int, whole: bool = False) -> int:
    """Bytes of the smallest staging ring for units on disk whose largest read is ``largest``
    bytes: one buffer, as large as that read or ``MIN_STAGING`` (then read in chunks).
    ``whole``: units coded in their files are on disk, and each is read in one piece (its
    chunks would land in the one device staging buffer that decodes it): as large as the read.
    """
    return _round_up(largest if whole else min(largest, MIN_STAGING), IO_ALIGN)


def arena_size(nbytes: int, pin: bool) -> int:
    """Host bytes an arena of ``nbytes`` takes: whole pages when it will be pinned."""
    return -(-nbytes // PAGE) * PAGE if pin else nbytes


def disk_spans(s: UnitSurvey) -> DiskSpans:
    """Where unit ``s``'s bytes lie in its files, placed as its arena holds them (a unit
    coded in its file: its blobs and raw bytes as its code packs them); its side entries
    (:func:`side_entries`) are not read.
    """
    code = file_code(s)
    if code is None:
        side = set(side_entries(s))
        return DiskSpans([(s.layout.offsets[i], f) for i, f in enumerate(s.files)
                          if i not in side])
    return DiskSpans([(code.offsets[i], f.blob if isinstance(f, CodedRef) else f)
                      for i, f in enumerate(s.files)])


def held_bytes(s: UnitSurvey) -> int:
    """Bytes of unit ``s``'s arena: its code's when its file holds it coded."""
    code = file_code(s)
    return code.nbytes if code is not None else s.layout.nbytes


def on_disk_views(s: UnitSurvey, code: UnitCode | None,
                  side: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """What an on-disk unit's tensors point at: private maps of their files (nothing read
    until touched); a coded tensor NaN (see :mod:`shuttle.offload.coded`); a side entry its
    host tensor in ``side``.
    """
    return [side[i] if i in side else code.placeholder(s.layout, i)
            if code is not None and code.coded[i] is not None
            else f.load() for i, f in enumerate(s.files)]


def host_floor(surveys: list[UnitSurvey], spans: list[DiskSpans | None], pin: bool
           ) -> tuple[int, int]:
    """(bytes of the units that stay in host memory and of the side entries of those that
    may not, bytes of the smallest staging ring).
    """
    fixed = sum(arena_size(held_bytes(s), pin) for s, sp in zip(surveys, spans, strict=True)
                if sp is None)
    fixed += side_size(surveys, spans, pin)
    whole = any(sp is not None and file_code(s) is not None
                for s, sp in zip(surveys, spans, strict=True))
    return fixed, staging_floor(max((sp.nbytes for sp in spans if sp is not None), default=0),
                                whole)


def _as_stored(f: LazyTensor | CodedRef | None, dtype: torch.dtype) -> bool:
    """Whether a file tensor is one span of bytes in ``dtype`` (a coded one: its blob)."""
    return (type(f) is LazyTensor or (isinstance(f, CodedRef) and type(f.blob) is LazyTensor)
            ) and f.dtype == dtype


def side_entries(s: UnitSurvey) -> list[int]:
    """The entries of unit ``s`` that its files do not hold as the unit does: stored in
    another dtype (a module diffusers keeps in float32 beside bfloat16 files, converted while
    read), pieced together from rows, or not in the files at all (a non-persistent buffer).
    While the unit is on disk they stay in host memory, converted once (its *side*: a few small
    tensors beside the bytes read on every load); a unit coded in its file has none.
    """
    return [i for i, f in enumerate(s.files) if not _as_stored(f, s.layout.dtypes[i])]


def side_layout(s: UnitSurvey) -> Layout:
    """Where unit ``s``'s side entries lie in its part of the storage's side arena."""
    return Layout.of([(s.layout.dtypes[i], s.layout.shapes[i]) for i in side_entries(s)])


def side_size(surveys: list[UnitSurvey], spans: list[DiskSpans | None], pin: bool) -> int:
    """Host bytes of the side arena (:func:`fill_sides`) of a capture under a ceiling."""
    return arena_size(sum(side_layout(s).nbytes for s, sp in zip(surveys, spans, strict=True)
                          if sp is not None), pin)


def fill_sides(surveys: list[UnitSurvey], spans: list[DiskSpans | None], pin: bool
               ) -> tuple[torch.Tensor | None, list[dict[int, torch.Tensor]]]:
    """One arena (``new_arena``; None when there is nothing to hold) with the side entries of
    every unit that may be on disk (``spans[i]`` not None), filled from their sources,
    converted where their dtype differs; per unit, entry -> its view (empty for the others).
    """
    layouts = [side_layout(s) if sp is not None else None
               for s, sp in zip(surveys, spans, strict=True)]
    total = sum(lay.nbytes for lay in layouts if lay is not None)
    if not total:
        return None, [{} for _ in surveys]
    arena = new_arena(total, pin)
    sides, at = [], 0
    for s, lay in zip(surveys, layouts, strict=True):
        entries = side_entries(s) if lay is not None else []
        views = lay.views(arena[at:at + lay.nbytes]) if entries else []
        with torch.no_grad():
            for i, view in zip(entries, views, strict=True):
                read_entry(s.sources[i], s.files[i], view)
        sides.append(dict(zip(entries, views, strict=True)))
        at += lay.nbytes if entries else 0
    return arena, sides


def spillable(s: UnitSurvey) -> bool:
    """Whether unit ``s`` can be read again from its files whenever needed: its tensors lie
    in files as they are stored, one span of bytes in the model's dtype each, but for its side
    entries (:func:`side_entries`), which stay in host memory. A unit whose host copy an
    optimizer step changed stays there whole (:func:`~shuttle.offload.training.host_step`
    makes it fixed). A tensor coded in its file (``shuttle compress``) is read coded: its blob
    is that span, and a coded unit has no side entries.
    """
    side = side_entries(s)
    return (s.layout.nbytes > 0 and len(side) < len(s.files)
            and (not side or file_code(s) is None))


class HostNeeds(NamedTuple):
    """Host bytes a model's capture needs (:meth:`HostStorage.needs`).

    Attributes:
        floor: the smallest ``max_host_bytes`` it can be captured under: the units that must
            stay in host memory plus one staging buffer (their bytes alone if none can stay
            on disk), or ``everything`` if that is less.
        everything: host bytes with every unit in an arena (no staging needed), and the
            side arena a ceiling allocates (:func:`side_entries`).
    """

    floor: int
    everything: int
    converted: int = 0  # of floor: bytes held only because their files store another dtype


def converted_bytes(surveys: list[UnitSurvey], spans: list[DiskSpans | None]) -> int:
    """Bytes of the units that stay in host memory only because their files store their
    tensors in another dtype than the model's (converted while read: a float32 release loaded
    in bfloat16): saved in the model's dtype they would stream from disk.
    """
    return sum(s.layout.nbytes for s, sp in zip(surveys, spans, strict=True)
               if sp is None and any(type(f) is LazyTensor and f.dtype != s.layout.dtypes[i]
                                     for i, f in enumerate(s.files)))


def convert_hint(converted: int) -> str:
    """What a refusal adds when ``converted`` bytes (:func:`converted_bytes`) raised a floor."""
    return (f"; {converted} of those bytes stay in host memory only because the files store "
            "them in another dtype than the model computes in (converted while read): write "
            "the folder once in the model's dtypes (`shuttle cast FOLDER OUT --dtype <the "
            "torch_dtype>`, one tensor in memory at a time) and load OUT: they stream from "
            "disk" if converted else "")
