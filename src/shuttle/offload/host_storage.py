"""Host storage: every parameter and buffer of a model captured once, in units.

A *unit* is one streamed block, one streamed layer (the direct parameters of one module, in
layer mode), or the rest of the model (everything outside them). Each
unit's unique tensors are laid out in one flat byte buffer (:class:`Layout`): offsets aligned to
16 bytes, tied tensors stored once. With ``host="pinned"`` that buffer is a host *arena*: one
allocation per unit, page-locked by registering exactly its bytes with CUDA (the caching host
allocator behind ``pin_memory()`` would round each allocation up to a power of two, up to 2x).
The module's parameters then point at views of the arena and the pageable originals are freed
unit by unit. With ``host="adopt"`` the module's own CPU tensors (pageable or mmap-backed) are
kept as they are: nothing is copied.

A quantized parameter (one a registered :class:`~shuttle.weights.WeightRepresentation` claims,
e.g. a bitsandbytes ``Params4bit`` with its ``QuantState``, or a quanto/torchao tensor subclass)
is captured as its storage tensors: each declared tensor of its representation (packed data,
scales, codes) is a layout entry of its own, and binding calls the representation's
``rebind``, so the parameter moves whole, in its stored form, never dequantized.

A ``DTensor`` (tensor parallelism, ``distribute_tensor``) is captured as its local shard: the
shard is the layout entry, and binding points the DTensor at its view (``bind_local``), so
each rank pins and streams only what it holds; placements, mesh and global shape stay. The
shard must be a plain tensor.

Without CUDA, pinning is unavailable: arenas are plain memory and :attr:`HostStorage.pinned`
is False.

What each unit holds and where each tensor is read from is surveyed first, changing nothing
(:mod:`shuttle.offload.survey`); the arenas themselves come from :mod:`shuttle.offload.arena`.

**A host ceiling** (``max_host_bytes``, with ``sources``): a unit whose every tensor comes from a
checkpoint file may be kept *on disk*: no arena, only where its tensors lie in the files
(:class:`~shuttle.offload.disk_reader.DiskSpans`); its parameters point at a private map of the
file while inactive (nothing read until touched), and each load reads it through the storage's
staging ring (:class:`~shuttle.offload.disk_reader.DiskReader`). Which units keep arenas and how
large the ring is are the residency plan's host tier, applied by :meth:`HostStorage.settle`. A
unit's few tensors that its files do not hold as it does (another dtype, a non-persistent
buffer) stay in host memory while it is on disk, in one small *side* arena
(:func:`~shuttle.offload.spill.side_entries`), and are copied after each of its loads; units
with nothing to read from a file, or a parameter that trains on the host, always keep their
arenas. ``host_bytes`` counts arenas, the side arena and staging buffers and never exceeds the
ceiling.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, TypeVar

import torch

from shuttle.errors import BudgetTooSmallError, HostBackingError
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.offload.arena import new_arena, register_pages, unregister_pages
from shuttle.offload.coded import (
    Compression,
    UnitCode,
    check_compress,
    codable,
    code_arena,
    file_code,
    fill_coded,
    plan_code,
    stages,
)
from shuttle.offload.disk_reader import IO_ALIGN, DiskReader, DiskSpans
from shuttle.offload.host_unit import HostUnit
from shuttle.offload.layout import Layout
from shuttle.offload.spill import (
    HostNeeds,
    arena_size,
    convert_hint,
    converted_bytes,
    disk_spans,
    fill_sides,
    held_bytes,
    host_floor,
    on_disk_views,
    side_size,
    spillable,
)
from shuttle.offload.survey import (
    UnitSurvey,
    adopted,
    fill_arena,
    read_binding,
    survey_units,
)

__all__ = ["Compression", "HostBacking", "HostNeeds", "HostStorage", "Layout"]

HostBacking = Literal["pinned", "adopt"]

_CAPTURE_WORKERS = 4  # arenas filled at once (more add little: docs/benchmarks/offload_capture.md)

T = TypeVar("T")

# A coded unit that is not a block (the rest of a model, often a module moved whole) is staged
# on the device in runs of about this many bytes, not whole (two buffers of a whole T5-XXL's
# code would be 12.8 GB of VRAM).
RUN_BYTES = 256 * 2**20


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _in_order(pool: ThreadPoolExecutor, fn: Callable[[int], T], count: int,
              window: int = _CAPTURE_WORKERS) -> Iterator[T]:
    """``fn(0) .. fn(count - 1)`` run on ``pool``, yielded in order, with at most ``window``
    calls submitted and not yet yielded.

    ``Executor.map`` submits every call at once: while the caller waits for one slow call (a
    module moved whole, gigabytes in one unit), the other workers would fill every later
    arena before the caller frees any unit's pageable originals, holding most of the model
    twice. Bounded, host memory holds at most ``window`` units twice.
    """
    pending: collections.deque[Future[T]] = collections.deque()
    for i in range(count):
        if len(pending) == window:
            yield pending.popleft().result()
        pending.append(pool.submit(fn, i))
    while pending:
        yield pending.popleft().result()


class HostStorage:
    """Every parameter and buffer of ``model``, captured into host memory once.

    Args:
        model: the model; with ``"pinned"`` its parameters are re-pointed (identity kept) at
            arena views and its buffers replaced by arena views.
        groups: block-list name -> its blocks; each block is one unit, the rest one more.
        host: ``"pinned"`` (copies into page-locked arenas) or ``"adopt"`` (zero-copy).
        layers: module path -> a module outside the blocks whose direct parameters form one
            unit each (layer mode); their buffers stay in the rest. Must be leaf modules.
        skip: parameters left out of every unit (not captured, never re-pointed): the
            trainable parameters an offloader keeps on the device.
        sources: qualified tensor name (any of a tied tensor's names) -> its tensor in a
            checkpoint file (:meth:`SafetensorsFile.tensor_ref
            <shuttle.formats.safetensors_file.SafetensorsFile.tensor_ref>`): read from there
            instead of from the module, so a model built on the ``meta`` device is filled
            straight from its files (``"pinned"``: read once into the arena; ``"adopt"``: a
            private map of the file, no copy). Its shape must be the tensor's, and its
            dtype too unless both are floating point (float16, bfloat16, float32, float64), or
            the file's is float8 and the model's one of those (widened exactly): then it is
            converted while read, through pieces of at most 16 MiB (``"adopt"``
            then holds a converted copy instead of a map).
        max_host_bytes: the ceiling on :attr:`host_bytes` (``"pinned"`` only). Units read from
            the files alone, as they are stored, start on disk; the others (:attr:`fixed`: a
            tensor the files lack, or one converted or pieced together while read) get their
            arenas now. :meth:`settle` then gives arenas to the units a plan chooses.
        compress: ``"lossless"``: keep the bfloat16/float16 tensors that code smaller coded
            in the arenas (``"pinned"`` only; see :mod:`shuttle.offload.coded`); None: as
            they are.
        progress: called with each unit's weight bytes when it gets its host copy (here, and
            in :meth:`settle` while :attr:`progress` is set): a progress bar's ``update``.

    Raises:
        HostBackingError: a tensor that cannot be kept as asked (on ``meta`` with no source,
            or a source of another shape or of a dtype not converted), ``max_host_bytes``
            with ``"adopt"``, or ``compress`` with ``"adopt"``.
        BlockLayoutError: a tensor spans two units (tied between a block and the rest, or
            between two blocks).
        BudgetTooSmallError: ``max_host_bytes`` cannot hold the units that must stay in host
            memory plus one staging buffer (the message names that floor).
        Nothing was changed when any of these is raised.

    Blocks of one group may differ in their tensors: each unit has its own :class:`Layout`.
    """

    def __init__(self, model: torch.nn.Module, groups: dict[str, Sequence[torch.nn.Module]],
                 host: HostBacking = "pinned", layers: dict[str, torch.nn.Module] | None = None,
                 skip: Sequence[torch.nn.Parameter] = (),
                 sources: Mapping[str, LazyTensor] | None = None,
                 max_host_bytes: int | None = None, compress: Compression | None = None,
                 progress: Callable[[int], None] | None = None):
        check_compress(compress, host)
        if max_host_bytes is not None and host == "adopt":
            raise HostBackingError(
                "max_host_bytes with host='adopt': adopted tensors are the module's own (or "
                "maps of its files), nothing shuttle allocates; use host='pinned' to bound "
                "what is kept in host memory")
        rest, surveyed, layer_units = survey_units(model, groups, host == "adopt", layers or {},
                                              frozenset(id(p) for p in skip), sources)
        self.host: HostBacking = host
        self.host_bytes = 0  # bytes this storage allocated on the host (arenas and staging)
        self.pinned_bytes = 0  # of which page-locked
        self.max_host_bytes = max_host_bytes
        self.reader: DiskReader | None = None  # the disk tier's reader (with a ceiling)
        self.side_bytes = 0  # host bytes of the side entries of the units that may be on disk
        self._pin = host == "pinned" and torch.cuda.is_available()
        self._registered: list[int] = []
        self._allocs: dict[int, tuple[int, bool]] = {}  # arena data_ptr -> (bytes, pinned)
        self._staging: list[torch.Tensor] = []
        self._compress = compress
        # told the weight bytes of each unit given host memory (until the owner clears it)
        self.progress = progress
        # Runs before the arenas are released (weakref callbacks precede clearing attributes).
        self._finalizer = weakref.finalize(self, unregister_pages, self._registered)
        surveys = [rest, *(u for us in surveyed.values() for u in us), *layer_units]
        spans = [disk_spans(s) if max_host_bytes is not None and spillable(s) else None
                 for s in surveys]
        if max_host_bytes is not None:
            self._check_floor(surveys, spans, max_host_bytes)
        units = self._capture_all(surveys, self._pin, spans)
        self.rest = units[0]
        self.groups, at = {}, 1
        for g, us in surveyed.items():
            self.groups[g], at = units[at:at + len(us)], at + len(us)
        self.layers = units[at:]

    @property
    def units(self) -> list[HostUnit]:
        """Every unit: the rest first, then each group's blocks in order, then the layers."""
        return [self.rest] + [u for units in self.groups.values() for u in units] + self.layers

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's unique tensors (tied weights counted once)."""
        return sum(u.layout.weight_bytes for u in self.units)

    @property
    def pinned(self) -> bool:
        """Whether every host byte is page-locked (False on a machine without CUDA)."""
        return self.host == "pinned" and self.pinned_bytes == self.host_bytes > 0

    @property
    def fixed(self) -> list[HostUnit]:
        """The units that keep their arenas whatever the plan (everything without a ceiling)."""
        return [u for u in self.units if u.spans is None]

    @property
    def coded_on_disk(self) -> bool:
        """Whether units that may stay on disk are coded in their files (each is then read
        in one piece: :func:`staging_floor`).
        """
        return any(u.disk_code is not None and u.spans is not None for u in self.units)

    @property
    def stage_bytes(self) -> int:
        """Device bytes an activation stages coded units in:
        :func:`~shuttle.offload.coded.stages` buffers of :attr:`stage_unit_bytes` each.
        """
        return stages() * self.stage_unit_bytes

    @property
    def stage_unit_bytes(self) -> int:
        """One staging buffer's bytes: the largest coded arena, held or planned (a unit on
        disk that an arena would keep coded), except the rest of the model, which often is a
        module moved whole (gigabytes: T5-XXL without block lists) and loads from its arena
        run by run (:meth:`~shuttle.offload.coded.UnitCode.pieces`) through a buffer of at
        least :data:`RUN_BYTES` and its largest entry. The same before and after the host tier
        changes; 0 when nothing is coded.
        """
        codes = [(u, c) for u in self.units for c in (u.code, u.planned, u.disk_code)
                 if c is not None]
        if not codes:
            return 0
        # A unit read coded from its file lands in one piece (the reader stages it whole).
        whole = [c.nbytes for u, c in codes
                 if u is not self.rest or (c is u.disk_code and u.spans is not None)]
        runs = [max(min(c.nbytes, RUN_BYTES), c.largest_entry(u.layout)) for u, c in codes]
        return max(whole + runs)

    @property
    def staging(self) -> tuple[int, int]:
        """The staging ring: ``(buffers, bytes each)``."""
        return len(self._staging), self._staging[0].numel() if self._staging else 0

    def arena_bytes(self, unit: HostUnit) -> int:
        """Host bytes an arena for ``unit`` takes (whole pages when it will be pinned; its
        code's bytes when it is kept coded, or will be: :attr:`HostUnit.planned`).
        """
        code = unit.code or unit.planned
        return arena_size(code.nbytes if code is not None else unit.layout.nbytes, self._pin)

    def settle(self, pinned: Collection[str] | None, staging: tuple[int, int]) -> None:
        """Give arenas to the units named in ``pinned`` (read from their files), take them from
        the other units that can be read again, and make the staging ring ``staging``
        (``(buffers, bytes each)``, bytes rounded up to whole 4 KiB blocks). Arenas are
        released first, so :attr:`host_bytes` never exceeds the larger of its value before and
        after. Only between activations. ``pinned=None`` (no ceiling): nothing changes.

        Raises:
            FileChangedError: a file to read changed since it was opened; the units read so far
                keep their arenas, the others stay on disk.
        """
        if pinned is None:
            return
        assert self.max_host_bytes is not None, "a host tier for a storage without a ceiling"
        assert self.reader is None or not self.reader.busy, "settle() during an activation"
        names = {u.name for u in self.units}
        assert set(pinned) <= names, f"unknown units {sorted(set(pinned) - names)[:4]}"
        want = set(pinned)
        drop = [u for u in self.units if u.spans is not None and u.arena is not None
                and u.name not in want]
        if (drop or self.staging != (staging[0], _round_up(staging[1], IO_ALIGN))) and \
                self._pin and torch.cuda.is_initialized():
            # Copies queued by an activation that ended may still read these buffers: the
            # host waits for them before the memory is unregistered and freed.
            for d in range(torch.cuda.device_count()):
                torch.cuda.synchronize(d)
        for u in drop:
            self._spill(u)
        self._set_staging(*staging)
        add = [u for u in self.units if u.on_disk and u.name in want]
        with ThreadPoolExecutor(_CAPTURE_WORKERS, thread_name_prefix="shuttle-pin") as pool:
            for u, filled in zip(add, pool.map(
                    lambda u: self._fill(u.survey, self._pin, u.planned), add), strict=True):
                self._keep(u, *filled)
        assert self.host_bytes <= self.max_host_bytes, \
            f"host tier of {self.host_bytes} bytes over max_host_bytes={self.max_host_bytes}"

    @staticmethod
    def needs(model: torch.nn.Module, groups: dict[str, Sequence[torch.nn.Module]],
              layers: dict[str, torch.nn.Module] | None = None,
              skip: Sequence[torch.nn.Parameter] = (),
              sources: Mapping[str, LazyTensor] | None = None) -> HostNeeds:
        """What capturing ``model`` (``"pinned"``, arguments as for the constructor) needs in
        host memory; changes nothing.

        Raises:
            HostBackingError, BlockLayoutError: as the constructor would.
        """
        rest, surveyed, layer_units = survey_units(model, groups, False, layers or {},
                                              frozenset(id(p) for p in skip), sources)
        surveys = [rest, *(u for us in surveyed.values() for u in us), *layer_units]
        spans = [disk_spans(s) if spillable(s) else None for s in surveys]
        pin = torch.cuda.is_available()
        fixed, stage = host_floor(surveys, spans, pin)
        everything = side_size(surveys, spans, pin) + sum(arena_size(held_bytes(s), pin)
                                                          for s in surveys)
        return HostNeeds(min(fixed + stage, everything), everything,
                         converted_bytes(surveys, spans))

    def _check_floor(self, surveys: list[UnitSurvey], spans: list[DiskSpans | None],
                     ceiling: int) -> None:
        held, stage = host_floor(surveys, spans, self._pin)
        if held + stage > ceiling and sum(arena_size(held_bytes(s), self._pin)
                                          for s in surveys) > ceiling:
            kept = [s.name or "(the rest of the model)" for s, sp in
                    zip(surveys, spans, strict=True) if sp is None and s.layout.nbytes]
            raise BudgetTooSmallError(
                f"max_host_bytes={ceiling} bytes cannot hold the {held} bytes that must stay in "
                f"host memory (units that cannot be read again from their files: {kept[:4]}; "
                f"and tensors the files hold in another dtype or lack, such as non-persistent "
                f"buffers) plus a staging buffer of {stage} bytes: give at least "
                f"{held + stage} bytes, or supply those tensors from files (sources=)"
                + convert_hint(converted_bytes(surveys, spans)))

    def _capture_all(self, surveys: list[UnitSurvey], pin: bool,
                     spans: list[DiskSpans | None]) -> list[HostUnit]:
        """Capture units in order; with ``"pinned"``, several are filled at once.

        Workers allocate, fill and register arenas (copies and registration release the
        GIL); this thread binds each unit as soon as it is ready, in order, which frees its
        pageable originals: host memory holds at most a few units twice. A unit in ``spill``
        starts on disk: its tensors point at maps of their files (with ``compress``, it is read
        once to size the coded arena a plan may give it: :func:`plan_code`).
        """
        if self.host == "adopt":
            return [self._adopt(s) for s in surveys]
        if any(sp is not None for sp in spans):
            self.reader = DiskReader()
        sides = self._sides(surveys, spans, pin)

        def planned(i: int) -> UnitCode | None:  # on disk: sized for the arena it may get
            s = surveys[i]
            return plan_code(s) if self._compress and file_code(s) is None else None

        units = []
        with ThreadPoolExecutor(_CAPTURE_WORKERS, thread_name_prefix="shuttle-pin") as pool:
            filled = _in_order(pool, lambda i: None if spans[i] else self._fill(surveys[i], pin),
                               len(surveys))
            plans = _in_order(pool, lambda i: planned(i) if spans[i] else None, len(surveys))
            for s, sp, got, plan in zip(surveys, spans, filled, plans, strict=True):
                unit = HostUnit(s.name, s.layout, s.bindings, [], None)
                if sp is not None:
                    unit.spans, unit.reader, unit.survey = sp, self.reader, s
                    unit.code = unit.disk_code = file_code(s)
                    unit.planned = plan
                    unit.side = sides[len(units)]
                    unit.host_views = on_disk_views(s, unit.code, unit.side)
                    unit.bind_host()
                else:
                    self._keep(unit, *got)  # the pageable originals are freed here
                units.append(unit)
        return units

    def _sides(self, surveys: list[UnitSurvey], spans: list[DiskSpans | None], pin: bool
               ) -> list[dict[int, torch.Tensor]]:
        """Per unit, its side entries (:func:`~shuttle.offload.spill.fill_sides`), their arena
        registered and counted (its views in the units keep it alive).
        """
        arena, sides = fill_sides(surveys, spans, pin)
        if arena is not None:
            pinned = pin and register_pages(arena, self._registered)
            self._allocs[arena.data_ptr()] = (arena.numel(), pinned)
            self.side_bytes = arena.numel()
            self.host_bytes += arena.numel()
            self.pinned_bytes += arena.numel() if pinned else 0
        return sides

    def _keep(self, unit: HostUnit, arena: torch.Tensor, allocated: int, pinned: bool,
              code: UnitCode | None = None) -> None:
        """Make ``arena`` (filled; coded by ``code``) ``unit``'s host copy and bind the unit
        to it.
        """
        self.host_bytes += allocated
        self.pinned_bytes += allocated if pinned else 0
        if allocated:
            self._allocs[arena.data_ptr()] = (allocated, pinned)
        unit.arena, unit.code = arena, code
        unit.host_views = (unit.layout.views(arena) if code is None
                           else code.placeholders(unit.layout, arena))
        unit.bind_host()
        if self.progress is not None:
            self.progress(unit.layout.weight_bytes)

    def _spill(self, unit: HostUnit) -> None:
        """Drop ``unit``'s arena: its tensors point at maps of their files again."""
        unit.code = unit.disk_code  # read from disk as its file holds it
        unit.host_views = on_disk_views(unit.survey, unit.code, unit.side)
        unit.bind_host()
        self._free(unit.arena)
        unit.arena = None

    def _free(self, buffer: torch.Tensor) -> None:
        """Give back ``buffer``'s registration and accounting (its memory goes with the last
        reference to it).
        """
        allocated, pinned = self._allocs.pop(buffer.data_ptr(), (0, False))
        if pinned:
            self._registered.remove(buffer.data_ptr())
            unregister_pages([buffer.data_ptr()])
        self.host_bytes -= allocated
        self.pinned_bytes -= allocated if pinned else 0

    def _set_staging(self, count: int, nbytes: int) -> None:
        nbytes = _round_up(nbytes, IO_ALIGN)
        if self.staging == (count, nbytes) or self.reader is None:
            return
        for b in self._staging:
            self._free(b)
        self._staging = []
        for _ in range(count):  # page-aligned with or without CUDA: O_DIRECT reads into them
            pages = new_arena(nbytes, pin=True)
            pinned = self._pin and register_pages(pages, self._registered)
            self._allocs[pages.data_ptr()] = (pages.numel(), pinned)
            self.host_bytes += pages.numel()
            self.pinned_bytes += pages.numel() if pinned else 0
            self._staging.append(pages)
        self.reader.set_buffers(self._staging, cuda=torch.cuda.is_available())

    def _fill(self, s: UnitSurvey, pin: bool, planned: UnitCode | None = None
              ) -> tuple[torch.Tensor, int, bool, UnitCode | None]:
        """A filled arena of exactly the unit's bytes (coded, with ``compress``, when that
        makes it smaller; as ``planned`` when the unit was sized on disk); the bytes
        allocated; whether pinned; its code.
        """
        code = file_code(s) or planned
        if code is not None:  # coded in its file (read as it is) or as planned
            pages = new_arena(code.nbytes, pin)
            fill_coded(s, code, pages[:code.nbytes])
            pinned = pin and pages.numel() > 0 and register_pages(pages, self._registered)
            return pages[:code.nbytes], pages.numel(), pinned, code
        n = s.layout.nbytes
        pages = new_arena(n, pin)
        fill_arena(s, pages[:n])
        if self._compress:  # coded straight into the arena that keeps it (plain: kept as is)
            coded = code_arena(s.layout, pages[:n], codable(s), lambda size: new_arena(size, pin))
            if coded is not None:
                pages, code = coded
                n = code.nbytes
        pinned = pin and pages.numel() > 0 and register_pages(pages, self._registered)
        return pages[:n], pages.numel(), pinned, code

    def _adopt(self, s: UnitSurvey) -> HostUnit:
        host = [adopted(src, s.layout, b) if src is not None else read_binding(b) if b.is_param
                else b.module._buffers[b.name] for b, src in zip(s.sources, s.files, strict=True)]
        unit = HostUnit(s.name, s.layout, s.bindings, host, None)
        if any(src is not None for src in s.files):
            unit.bind_host()  # the file's pages (a private map), not the module's tensors
        return unit
