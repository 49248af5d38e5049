"""Units kept lossless coded in host memory and decoded on the device as they land.

With ``compress="lossless"`` (:class:`~shuttle.offload.host_storage.HostStorage`) every
bfloat16/float16 tensor of a unit that codes smaller
(:class:`~shuttle.weights.lossless.LosslessTensor`, about 0.7x) is kept coded: the unit's host
arena holds the coded blobs and the other tensors' raw bytes, packed (:class:`UnitCode`). A load
copies that arena into a device staging buffer (one copy, ~0.7x the bytes over the bus), then
decodes each blob into its tensor's view of the slot and copies the raw tensors' bytes across
(:class:`Decoder`); the slot's loaded event is recorded after both, so a block's kernels never
see a half-decoded weight. On CUDA the decode runs on a stream of its own, so that the copy
engine moves the next unit while this one decodes (serialized on the copy stream, a step would
cost the copy plus the decode):

    copy stream:    wait free[j] -> copy arena into stage j -> record filled[j]
    decode stream:  wait filled[j] -> decode stage j into the slot -> record free[j], loaded[s]

with :func:`stages` staging buffers used in turn, each sized by the largest coded block (the
rest of a model, often a module moved whole, loads run by run: :meth:`UnitCode.pieces`); the
residency plan counts them (``HostStorage.stage_bytes``). ``SHUTTLE_DECODE_STREAM=0``
(:data:`DECODE_STREAM_ENV`) turns the decode stream off: the decode then runs on the copy stream
after each copy, through one staging buffer: one buffer less of VRAM, and a step that costs the
coded copy plus the decode instead of the larger of the two (docs/lossless.md). The decode
stream waits on ``filled[j]``, recorded after the copy stream waited for the slot's last reader,
so it writes the slot only once that reader is done. Where adapters merge as slots land, the
merge runs on the copy stream once the decode is done (the decode stream carries no matmuls,
hence no cuBLAS workspace of its own).

A damaged code is counted on the device (no synchronization per load); the activation checks
the count when it ends and raises :class:`~shuttle.errors.CorruptCodeError`.

Not coded: quantized storage tensors and DTensor shards (their own representations), and
tensors too small to gain. Parameters that train on the host (``optimizer_step``) cannot lie in
a coded unit: train with ``trainable="device"``, or without ``compress``. While the
model is inactive a coded tensor has no decoded host copy: its parameter reads as NaN (and
refuses writes) until the next activation binds it to a slot, and :meth:`UnitCode.decoded`
gives the values on the host where the offloader needs them (the CPU pass-through, giving a
model back).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from shuttle.errors import CorruptCodeError, HostBackingError
from shuttle.offload.layout import ALIGN, Layout
from shuttle.offload.survey import UnitSurvey, read_entry
from shuttle.weights.lossless import CODED_DTYPES, LosslessTensor
from shuttle.weights.lossless_file import CodedRef

__all__ = ["DECODE_STREAM_ENV", "Compression", "Decoder", "UnitCode", "check_compress",
           "codable", "code_arena", "decode_stream_enabled", "file_code", "fill_coded",
           "plan_code", "stages"]

Compression = Literal["lossless"]

DECODE_STREAM_ENV = "SHUTTLE_DECODE_STREAM"


def decode_stream_enabled() -> bool:
    """Whether coded loads decode on a stream of their own: yes unless
    ``SHUTTLE_DECODE_STREAM=0``.
    """
    return os.environ.get(DECODE_STREAM_ENV, "1") != "0"


def stages() -> int:
    """Staging buffers of an activation's decoder: with a decode stream, one being filled while
    the other decodes; else one.
    """
    return 2 if decode_stream_enabled() else 1


@dataclasses.dataclass(frozen=True)
class UnitCode:
    """How a unit's coded host arena maps onto its :class:`Layout`.

    Attributes:
        offsets: per layout entry, where its bytes (a blob, or the raw tensor) start in the
            coded arena.
        coded: per layout entry, its :class:`LosslessTensor` with the blob left out (only the
            layout: shape, dtype, words), or None where the entry is kept raw.
        nbytes: bytes of the coded arena.
    """

    offsets: tuple[int, ...]
    coded: tuple[LosslessTensor | None, ...]
    nbytes: int

    def _size(self, layout: Layout, i: int) -> int:
        rep = self.coded[i]
        if rep is not None:
            return rep.blob.numel()
        return layout.shapes[i].numel() * layout.dtypes[i].itemsize

    def _raw(self, layout: Layout, arena: torch.Tensor, i: int) -> torch.Tensor:
        at = self.offsets[i]
        return arena[at:at + self._size(layout, i)].view(layout.dtypes[i]).view(layout.shapes[i])

    def pieces(self, layout: Layout, limit: int) -> list[tuple[int, int, range]]:
        """The arena cut between entries into runs of at most ``limit`` bytes (an entry larger
        than ``limit`` is a run of its own): ``(start, end, entries)`` per run, in order. A
        coded unit larger than the decoder's staging buffer is loaded run by run.
        """
        runs: list[tuple[int, int, range]] = []
        first = 0
        for i in range(1, len(self.offsets) + 1):
            end = self.offsets[i - 1] + self._size(layout, i - 1)
            if i == len(self.offsets) or (self.offsets[i] + self._size(layout, i)
                                          - self.offsets[first] > limit):
                runs.append((self.offsets[first], end, range(first, i)))
                first = i
        return runs

    def largest_entry(self, layout: Layout) -> int:
        """Bytes of the unit's largest entry (coded or raw): the least a staging buffer takes
        to load it run by run (:meth:`pieces`).
        """
        return max((self._size(layout, i) for i in range(len(self.offsets))), default=0)

    @staticmethod
    def placeholder(layout: Layout, i: int) -> torch.Tensor:
        """What coded entry ``i`` points at while inactive: a NaN of its dtype expanded to its
        shape (no memory; reads give NaN, writes raise).
        """
        return torch.full((), float("nan"), dtype=layout.dtypes[i]).expand(layout.shapes[i])

    def placeholders(self, layout: Layout, arena: torch.Tensor) -> list[torch.Tensor]:
        """What the unit's tensors point at while inactive: raw entries their bytes in
        ``arena``, coded ones :meth:`placeholder`.
        """
        return [self._raw(layout, arena, i) if rep is None else self.placeholder(layout, i)
                for i, rep in enumerate(self.coded)]

    def decoded(self, layout: Layout, arena: torch.Tensor) -> list[torch.Tensor]:
        """Every entry's tensor on the host, coded ones decoded into fresh memory.

        Raises:
            CorruptCodeError: a blob in ``arena`` was damaged.
        """
        out = []
        for i, rep in enumerate(self.coded):
            if rep is None:
                out.append(self._raw(layout, arena, i))
            else:
                at = self.offsets[i]
                blob = arena[at:at + rep.blob.numel()]
                out.append(dataclasses.replace(rep, blob=blob).decode())
        return out


def _packed(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where entries of ``sizes`` bytes start when packed in order at ``ALIGN``, and the total."""
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at = -(-(at + size) // ALIGN) * ALIGN
    return offsets, at


def _raw_bytes(layout: Layout, i: int) -> int:
    return layout.shapes[i].numel() * layout.dtypes[i].itemsize


def _pack(layout: Layout, reps: Sequence[LosslessTensor | None]) -> UnitCode:
    """The code of a unit whose entries ``reps`` (None: raw) are packed in order."""
    offsets, at = _packed([rep.blob.numel() if rep is not None else _raw_bytes(layout, i)
                           for i, rep in enumerate(reps)])
    layout_only = tuple(r if r is None or r.blob.is_meta else dataclasses.replace(
        r, blob=torch.empty(r.blob.numel(), dtype=torch.uint8, device="meta")) for r in reps)
    return UnitCode(tuple(offsets), layout_only, at)


def file_code(s: UnitSurvey) -> UnitCode | None:
    """The code of unit ``s`` as a compressed checkpoint supplies it (its tensors that the
    file holds coded, in the model's dtype, stay coded), or None when it supplies none so.
    """
    reps = [f.layout() if isinstance(f, CodedRef) and f.dtype == s.layout.dtypes[i] else None
            for i, f in enumerate(s.files)]
    return None if all(r is None for r in reps) else _pack(s.layout, reps)


def plan_code(s: UnitSurvey) -> UnitCode | None:
    """The code :func:`code_arena` would make of unit ``s``, found without coding: each
    eligible tensor read from its source in turn and sized
    (:meth:`~shuttle.weights.lossless.LosslessTensor.code_size`); None when nothing would code
    smaller. A unit under a host ceiling is planned so while it waits on disk: the residency
    plan counts the arena it would get, and :func:`fill_coded` writes it.
    """
    eligible = codable(s)
    reps: list[LosslessTensor | None] = [None] * len(s.layout.offsets)
    seen: set[int] = set()
    with torch.no_grad():
        for b, src in zip(s.sources, s.files, strict=True):
            i = b.entry  # a tied tensor's entry is sized once
            shape, dtype = s.layout.shapes[i], s.layout.dtypes[i]
            if i in seen or not eligible[i] or dtype not in CODED_DTYPES:
                continue
            seen.add(i)
            t = torch.empty(shape, dtype=dtype)
            read_entry(b, src, t)
            got = LosslessTensor.code_size(t)
            if got is not None:
                words, nbytes = got
                reps[i] = LosslessTensor(torch.empty(nbytes, dtype=torch.uint8, device="meta"),
                                         shape, dtype, words)
    return None if all(r is None for r in reps) else _pack(s.layout, reps)


def fill_coded(s: UnitSurvey, code: UnitCode, arena: torch.Tensor) -> None:
    """Fill ``arena`` (``code.nbytes``) with unit ``s`` as ``code`` lays it out: a coded
    tensor's blob read from its file as it is (a compressed checkpoint's, :func:`file_code`) or
    coded here from the tensor read (:func:`plan_code`'s, one tensor at a time: no plain copy
    of the unit); the other tensors' bytes read from the file or the module.
    """
    with torch.no_grad():
        for b, src in zip(s.sources, s.files, strict=True):
            i, at = b.entry, code.offsets[b.entry]
            rep = code.coded[i]
            if rep is None:
                read_entry(b, src, code._raw(s.layout, arena, i))
            elif isinstance(src, CodedRef) and src.dtype == s.layout.dtypes[i]:
                src.blob.load_into(arena[at:at + rep.blob.numel()])
            else:
                t = torch.empty(s.layout.shapes[i], dtype=s.layout.dtypes[i])
                read_entry(b, src, t)
                got = LosslessTensor.encode_host(t)
                assert got is not None and got.words == rep.words, \
                    f"{s.name}: entry {i} codes otherwise than its plan"
                arena[at:at + got.blob.numel()].copy_(got.blob)


def code_arena(layout: Layout, arena: torch.Tensor, eligible: Sequence[bool],
               alloc: Callable[[int], torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, UnitCode] | None:
    """``arena`` (a unit's plain host arena, laid out by ``layout``) with its ``eligible``
    bfloat16/float16 entries coded where that makes them smaller: the buffer ``alloc(nbytes)``
    gave (at least ``nbytes``; default a pageable one of exactly that), filled in its first
    ``nbytes``, and its :class:`UnitCode`; None when nothing codes smaller (nothing allocated).
    The coded unit is written once, into the buffer that keeps it.
    """
    views = layout.views(arena)
    reps: list[LosslessTensor | None] = [
        LosslessTensor.encode_host(v) if ok and v.dtype in CODED_DTYPES else None
        for v, ok in zip(views, eligible, strict=True)]
    if all(r is None for r in reps):
        return None
    code = _pack(layout, reps)
    coded = (alloc or functools.partial(torch.empty, dtype=torch.uint8))(code.nbytes)
    for v, rep, off in zip(views, reps, code.offsets, strict=True):
        src = rep.blob if rep is not None else v.reshape(-1).view(torch.uint8)
        coded[off:off + src.numel()].copy_(src)
    return coded, code


class Decoder:
    """The device side of one activation's coded loads: :func:`stages` staging buffers, the
    decode stream (where enabled), and an error count.

    Args:
        device: the activation's device.
        nbytes: each staging buffer's size (``HostStorage.stage_unit_bytes``): a larger coded
            arena loads run by run.
        copy_stream: the CUDA stream every load's copy runs on (None: synchronous copies,
            decoded on the current stream).
    """

    def __init__(self, device: torch.device, nbytes: int,
                 copy_stream: torch.cuda.Stream | None = None):
        overlap = copy_stream is not None and decode_stream_enabled()
        n_stages = 2 if overlap else 1
        self.stages = [torch.empty(nbytes, dtype=torch.uint8, device=device)
                       for _ in range(n_stages)]
        self.errors = torch.zeros(1, dtype=torch.int32, device=device)
        # None: decoded on the current stream (the copy stream on CUDA), in order
        self.stream = decode_stream_of(device) if overlap else None
        cuda = self.stream is not None
        self._filled = [torch.cuda.Event() if cuda else None for _ in range(n_stages)]
        self._free = [torch.cuda.Event() if cuda else None for _ in range(n_stages)]
        self._decoded = torch.cuda.Event() if cuda else None
        self._next = 0
        if copy_stream is not None:
            # The new buffers may reuse memory that queued compute kernels still touch.
            current = torch.cuda.current_stream(device)
            copy_stream.wait_stream(current)
            if self.stream is not None:
                self.stream.wait_stream(current)

    def stage(self) -> tuple[int, torch.Tensor]:
        """The next staging buffer ``(index, buffer)``; on CUDA the current (copy) stream first
        waits until the decode that last read it is done.
        """
        j, self._next = self._next, (self._next + 1) % len(self.stages)
        if self.stream is not None:
            torch.cuda.current_stream(self.stages[j].device).wait_event(self._free[j])
        return j, self.stages[j]

    def load(self, code: UnitCode, layout: Layout, arena: torch.Tensor, flat: torch.Tensor,
             views: Sequence[torch.Tensor], non_blocking: bool) -> torch.cuda.Stream | None:
        """Queue the load of a coded unit (``arena``) into ``flat`` / ``views`` (its slot): a
        copy of the arena into a staging buffer on the current stream, then per entry a decode
        or a device copy of its raw bytes (:meth:`decode`). A unit larger than a staging buffer
        (a module moved whole) is copied and decoded run by run (:meth:`UnitCode.pieces`), the
        staging buffers taking turns.

        Returns:
            The stream whose queued work completes the slot (None: done in order on the
            current stream).
        """
        size = self.stages[0].numel()
        if code.nbytes <= size:
            runs = [(0, code.nbytes, range(len(code.offsets)))]
        else:
            runs = code.pieces(layout, size)
        done = None
        for start, end, entries in runs:
            j, stage = self.stage()
            stage[:end - start].copy_(arena[start:end], non_blocking=non_blocking)
            done = self.decode(j, code, layout, flat, views, entries, start)
        return done

    def decode(self, j: int, code: UnitCode, layout: Layout, flat: torch.Tensor,
               views: Sequence[torch.Tensor], entries: range | None = None,
               start: int = 0) -> torch.cuda.Stream | None:
        """Queue the decode of ``entries`` (default: all) of the coded unit whose arena bytes
        from ``start`` staging buffer ``j`` holds (filled by work queued so far on the current
        stream: copied, or read from disk) into ``flat`` / ``views``: on the decode stream on
        CUDA, else on the current stream.

        Returns:
            The decode stream (record the slot's loaded event there), or None.
        """
        entries = range(len(code.offsets)) if entries is None else entries
        if self.stream is None:
            self._unpack(self.stages[j], code, layout, flat, views, entries, start)
            return None
        self._filled[j].record(torch.cuda.current_stream(self.stages[j].device))
        self.stream.wait_event(self._filled[j])
        with torch.cuda.stream(self.stream):
            self._unpack(self.stages[j], code, layout, flat, views, entries, start)
            self._free[j].record(self.stream)
        return self.stream

    def after_decode(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream`` wait for every decode queued so far (a merge that reads the slot)."""
        if self.stream is not None:
            self._decoded.record(self.stream)
            stream.wait_event(self._decoded)

    def join(self) -> None:
        """Order later work on the current stream after every decode queued so far (before the
        slots or the staging buffers are freed, or the error count is read).
        """
        if self.stream is not None:
            torch.cuda.current_stream(self.stages[0].device).wait_stream(self.stream)

    def _unpack(self, stage: torch.Tensor, code: UnitCode, layout: Layout, flat: torch.Tensor,
                views: Sequence[torch.Tensor], entries: range, start: int) -> None:
        for i in entries:
            rep, at = code.coded[i], code.offsets[i] - start
            if rep is None:
                n = layout.shapes[i].numel() * layout.dtypes[i].itemsize
                flat[layout.offsets[i]:layout.offsets[i] + n].copy_(stage[at:at + n])
            else:
                rep.decode_into(views[i], self.errors, stage[at:at + rep.blob.numel()])

    def check(self) -> None:
        """Raise if any decode so far found a damaged code (synchronizes with the device).

        Raises:
            CorruptCodeError: the count of damaged groups is not zero.
        """
        self.join()
        bad = int(self.errors.item())
        if bad:
            raise CorruptCodeError(
                f"{bad} group(s) of lossless-coded weights failed their checks while loading: "
                "the host copy was damaged, and the outputs computed with it are not to be "
                "trusted; capture the model again (from_module(..., compress='lossless'))")


def codable(s: UnitSurvey) -> list[bool]:
    """Per layout entry of ``s``, whether it may be coded: not a quantized part or a shard
    (those have representations of their own).
    """
    ok = [True] * len(s.layout.offsets)
    for b in s.bindings:
        if b.rep is not None or b.shard:
            ok[b.entry] = False
    return ok


def check_compress(compress: Compression | None, host: str) -> None:
    """Refuse a ``compress`` that host storage cannot honour with ``host``.

    Raises:
        HostBackingError: an unknown ``compress``, or one with ``host="adopt"``.
    """
    if compress not in (None, "lossless"):
        raise HostBackingError(f"compress={compress!r}: expected 'lossless' or None")
    if compress is not None and host != "pinned":
        raise HostBackingError(
            f"compress={compress!r} codes the host arenas of host='pinned' storage; with "
            f"host={host!r} the module's own tensors are kept as they are: drop compress, or "
            "use host='pinned'")


_DECODE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def decode_stream_of(device: torch.device) -> torch.cuda.Stream:
    """The stream coded loads decode on, one per device for every activation (as the copy
    stream: activations that share it are ordered by their events).
    """
    stream = _DECODE_STREAMS.get(device)
    if stream is None:
        stream = _DECODE_STREAMS[device] = torch.cuda.Stream(device)
    return stream
