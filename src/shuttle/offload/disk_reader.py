"""The disk tier: units read from their safetensors files on every load, through a staging ring.

A unit that does not fit under the host ceiling keeps no arena, only where its tensors lie in
their files (:class:`DiskSpans`). Each load of it reads those bytes into one of a few pinned,
page-aligned *staging buffers* on reader threads, then copies them from there into its device
slot. Three parties, ordered by one event per staging buffer and the slot pool's two per slot:

    reader thread:  wait staged[b] -> read the unit's file extents into buffer b
    main thread:    once that read landed (polled at every pool call, or waited for by
                    wait_loaded): queue on the copy stream
                    wait freed[s] -> copy buffer b's runs into slot s -> record staged[b]
                    (after the unit's last chunk: fold adapters, record loaded[s])
    compute stream: wait loaded[s] -> the block's kernels -> record freed[s]

so a staging buffer is read into again only after the copies out of it ran, and the main thread
waits on the host only for a read still in flight when its block is about to run. Reads are
queued in load order (the streamer's prefetch order) and read ahead as far as free buffers
allow; a buffer is handed to the next read only when the copies out of it are queued, so the
event its reader waits for is always the right one. Without CUDA the copies are synchronous
and there are no events.

**Layout of a read.** The unit's tensors are grouped into *extents*: runs of one file whose
gaps are at most ``_GAP`` bytes, widened to whole 4 KiB blocks, laid one after another in the
buffer. A tensor then lies in the buffer at its extent's place plus its distance from the
extent's start, and one copy per run of tensors that are as far apart in the buffer as in the
slot's layout moves it. A unit larger than a buffer is read in buffer-sized *chunks* (any
tensor may straddle two); each chunk is one read and its share of the copies.

**O_DIRECT.** File offsets, lengths and buffer addresses are 4 KiB-aligned, so the files are
opened with ``O_DIRECT`` (no page cache: reading a model larger than the host memory neither
evicts everything else nor depends on what the cache holds). A filesystem that refuses it
(tmpfs, some network and FUSE filesystems) is read with buffered reads instead, the same
requests. Each chunk's read is split into pieces read in parallel (several requests in flight
keep an NVMe queue busy).

**Files that change.** Every chunk opens its files by path and compares their identity (device,
inode, size, modification time) with the one recorded when they were opened, before and after
reading, and a read that ends early is an error: a file replaced, rewritten or truncated while
a model streams from it raises :class:`~shuttle.errors.FileChangedError` when the load it
spoiled is waited for, and the slot never counts as loaded (every later wait on it raises too).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from shuttle.errors import AdapterFileError, FileChangedError
from shuttle.formats.safetensors_file import LazyTensor, SafetensorsFile
from shuttle.offload.layout import ALIGN  # the alignment of tensors in a unit's layout

__all__ = ["DiskLoad", "DiskReader", "DiskSpans", "IO_ALIGN", "read_bandwidth"]

IO_ALIGN = 4096  # O_DIRECT alignment of file offsets, lengths and memory (any block device's)
_GAP = 32 * 2**10  # read through gaps up to this many bytes rather than issue another request
_PIECE = 8 * 2**20  # a chunk's read is split into pieces of at most this, read in parallel
_WORKERS = 4  # piece readers shared by every reader of the process


@functools.cache
def _piece_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_WORKERS, thread_name_prefix="shuttle-disk")


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class _Read(NamedTuple):
    file: SafetensorsFile
    offset: int  # aligned file offset
    at: int  # aligned offset in the buffer
    length: int  # aligned length
    need: int  # bytes from ``offset`` that must exist (the rest widens to a whole block)


class _Copy(NamedTuple):
    at: int  # offset in the buffer
    to: int  # offset in the unit's layout (the slot)
    n: int


class _Chunk(NamedTuple):
    reads: tuple[_Read, ...]
    copies: tuple[_Copy, ...]


class DiskSpans:
    """Where one unit's tensors lie in their files, and how a load reads and copies them.

    Args:
        entries: ``(offset in the unit's layout, tensor in its file)`` per layout entry.

    Attributes:
        nbytes: buffer bytes that one read of the whole unit takes (its extents, widened to
            whole 4 KiB blocks): the staging buffer size that reads the unit in one chunk.
        files: the files read.
    """

    def __init__(self, entries: Sequence[tuple[int, LazyTensor]]):
        by_file: dict[int, list[tuple[int, int, int]]] = {}
        files: dict[int, SafetensorsFile] = {}
        for to, t in entries:
            if t.nbytes:
                files[id(t.file)] = t.file
                by_file.setdefault(id(t.file), []).append((t.offset, t.offset + t.nbytes, to))
        # extents: (file, aligned start, aligned end, true end, buffer offset)
        self._extents: list[tuple[SafetensorsFile, int, int, int, int]] = []
        pieces: list[_Copy] = []
        at = 0
        for key, spans in by_file.items():
            spans.sort()
            start, end, members = spans[0][0], spans[0][1], [spans[0]]
            for span in [*spans[1:], None]:
                if span is not None and span[0] - end <= _GAP:
                    end = max(end, span[1])
                    members.append(span)
                    continue
                a0, a1 = start // IO_ALIGN * IO_ALIGN, _round_up(end, IO_ALIGN)
                self._extents.append((files[key], a0, a1, end, at))
                pieces += [_Copy(at + s - a0, to, e - s) for s, e, to in members]
                at += a1 - a0
                if span is not None:
                    start, end, members = span[0], span[1], [span]
        self.nbytes = at
        self.files = list(files.values())
        self._runs = _merge_runs(pieces)
        self._chunks: dict[int, tuple[_Chunk, ...]] = {}

    def chunks(self, capacity: int) -> tuple[_Chunk, ...]:
        """The reads and copies of one load through buffers of ``capacity`` bytes (a multiple of
        ``IO_ALIGN``), one chunk per buffer-full.
        """
        assert capacity > 0 and capacity % IO_ALIGN == 0, capacity
        if capacity not in self._chunks:
            self._chunks[capacity] = self._split(capacity)
        return self._chunks[capacity]

    def _split(self, capacity: int) -> tuple[_Chunk, ...]:
        out = []
        for lo in range(0, self.nbytes, capacity):
            hi = min(lo + capacity, self.nbytes)
            reads = []
            for file, a0, a1, end, at in self._extents:
                x0, x1 = max(lo, at), min(hi, at + a1 - a0)
                for p0 in range(x0, x1, _PIECE):
                    p1 = min(p0 + _PIECE, x1)
                    offset = a0 + p0 - at
                    reads.append(_Read(file, offset, p0 - lo, p1 - p0,
                                       max(0, min(p1 - p0, end - offset))))
            copies = [_Copy(max(c.at, lo) - lo, c.to + max(c.at, lo) - c.at,
                            min(c.at + c.n, hi) - max(c.at, lo))
                      for c in self._runs if c.at < hi and c.at + c.n > lo]
            out.append(_Chunk(tuple(reads), tuple(copies)))
        return tuple(out)


def _merge_runs(pieces: list[_Copy]) -> list[_Copy]:
    """Copies sorted by layout offset, neighbours that lie as far apart in the buffer as in the
    layout joined into one (the bytes between are alignment padding of the layout).
    """
    runs: list[_Copy] = []
    for c in sorted(pieces, key=lambda c: c.to):
        last = runs[-1] if runs else None
        if (last is not None and c.to - last.to == c.at - last.at
                and 0 <= c.to - (last.to + last.n) < ALIGN):
            runs[-1] = _Copy(last.at, last.to, c.to + c.n - last.to)
        else:
            runs.append(c)
    return runs


Land = Callable[[torch.Tensor, Sequence[_Copy], bool, bool, "torch.cuda.Event | None"], None]


class DiskLoad:
    """One unit's load through the reader: its chunks, and the error that spoiled it, if any."""

    def __init__(self, owner: Any, reader: DiskReader, chunks: tuple[_Chunk, ...], land: Land):
        self.owner = owner  # the slot pool that asked (drained with it)
        self.reader = reader
        self.chunks = chunks
        self.land = land
        self.landed = 0  # chunks whose copies are queued
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        """Whether every chunk landed (or the load failed)."""
        return self.error is not None or self.landed == len(self.chunks)


class _Job(NamedTuple):
    load: DiskLoad
    index: int  # which chunk


class DiskReader:
    """Reads units kept on disk into staging buffers, in load order, ahead of their use.

    Every method is called from the main thread; reads run on a reader thread (one per reader,
    so reads happen in load order) that splits each into pieces read by a shared pool.

    Args:
        direct: open files with ``O_DIRECT`` where the filesystem allows.
    """

    def __init__(self, direct: bool = True):
        self.direct = direct
        self.buffers: list[torch.Tensor] = []
        self._staged: list[torch.cuda.Event | None] = []
        self._free: collections.deque[int] = collections.deque()
        self._queue: collections.deque[_Job] = collections.deque()  # waiting for a buffer
        self._reading: collections.deque[tuple[_Job, int, Future]] = collections.deque()
        self._refused: set[int] = set()  # st_dev of filesystems that refused O_DIRECT
        self._lock = threading.Lock()
        self._thread: ThreadPoolExecutor | None = None
        self.bytes_read = 0  # file bytes read (host-side counter, for tests and reports)

    @property
    def capacity(self) -> int:
        """Bytes of each staging buffer (0: none)."""
        return self.buffers[0].numel() if self.buffers else 0

    @property
    def busy(self) -> bool:
        """Whether a load is queued or being read."""
        return bool(self._queue or self._reading)

    def set_buffers(self, buffers: Sequence[torch.Tensor], cuda: bool) -> None:
        """Use ``buffers`` (page-aligned CPU ``uint8``, one size, a multiple of ``IO_ALIGN``)
        as the staging ring; ``cuda``: copies out of them run on CUDA streams (one event each).
        Only while no load is in progress.
        """
        assert not self.busy, "staging buffers change only while the reader is idle"
        assert all(b.numel() % IO_ALIGN == 0 and b.data_ptr() % IO_ALIGN == 0 for b in buffers)
        self.buffers = list(buffers)
        self._staged = [torch.cuda.Event() if cuda else None for _ in self.buffers]
        self._free = collections.deque(range(len(self.buffers)))

    def submit(self, owner: Any, spans: DiskSpans, land: Land) -> DiskLoad:
        """Queue a load of the unit ``spans`` describes.

        ``land(buffer, copies, first, last, staged)`` is called on the main thread for each
        chunk once its read landed: it queues the copies out of ``buffer`` and records
        ``staged`` (None without CUDA) after them; ``first``/``last`` mark the unit's first and
        last chunk.
        """
        assert self.buffers, "a unit on disk is loaded without staging buffers"
        load = DiskLoad(owner, self, spans.chunks(self.capacity), land)
        self._queue.extend(_Job(load, i) for i in range(len(load.chunks)))
        self.pump()
        return load

    def pump(self) -> None:
        """Land every read that finished (in order) and start queued reads on free buffers.
        Never waits and never raises: a failed load keeps its error for :meth:`finish`.
        """
        while self._reading and self._reading[0][2].done():
            self._land(*self._reading.popleft())
        while self._queue and self._free:
            job = self._queue.popleft()
            if job.load.error is not None:
                continue
            b = self._free.popleft()
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="shuttle-stage")
            future = self._thread.submit(self._read, job.load.chunks[job.index], b)
            self._reading.append((job, b, future))

    def finish(self, load: DiskLoad) -> None:
        """Wait until ``load`` landed (on the host only while its reads are in flight).

        Raises:
            FileChangedError: a file it reads changed since it was opened.
            AdapterFileError: a file could not be read.
        """
        while not load.done:
            self.pump()
            if load.done:
                break
            assert self._reading, "a queued load with no read in flight"
            self._reading[0][2].exception()  # waits for the oldest read
        if load.error is not None:
            raise load.error

    def drain(self, owner: Any) -> None:
        """Drop the queued loads of ``owner`` and wait for its reads in flight (nothing of
        them is copied); other owners' loads land as usual.
        """
        self._queue = collections.deque(j for j in self._queue if j.load.owner is not owner)
        while any(job.load.owner is owner for job, _, _ in self._reading):
            job, b, future = self._reading.popleft()
            future.exception()
            if job.load.owner is owner:
                job.load.error = job.load.error or _Dropped()
                self._free.append(b)
            else:
                self._land(job, b, future)
        self.pump()

    def _land(self, job: _Job, b: int, future: Future) -> None:
        load = job.load
        try:
            err = future.exception()
            if err is not None:
                load.error = load.error or err
            if load.error is None:
                last = job.index == len(load.chunks) - 1
                load.land(self.buffers[b], load.chunks[job.index].copies, job.index == 0, last,
                          self._staged[b])
                load.landed += 1
        except Exception as e:  # a failing copy or fold: raised when the load is waited for
            load.error = load.error or e
        finally:
            self._free.append(b)

    # -- reader thread ---------------------------------------------------------------------
    def _read(self, chunk: _Chunk, b: int) -> None:
        staged = self._staged[b]
        if staged is not None:
            staged.synchronize()  # the copies out of this buffer ran
        buffer = self.buffers[b]
        files = list({id(r.file): r.file for r in chunk.reads}.values())
        fds = {}
        try:
            for f in files:
                fds[id(f)] = self._open(f)
            for f in files:
                f._check_unchanged(fds[id(f)][0])
            pieces = [_piece_pool().submit(self._pread, fds[id(r.file)], buffer, r)
                      for r in chunk.reads]
            errors = [p.exception() for p in pieces]  # every piece ends before fds close
            if any(isinstance(e, _DirectRefused) for e in errors):
                for fd, direct in fds.values():
                    if direct:
                        self._refused.add(os.fstat(fd).st_dev)
                    os.close(fd)
                fds.clear()
                return self._read(chunk, b)  # again, buffered
            for e in errors:
                if e is not None:
                    raise e
            for f in files:
                f._check_unchanged(fds[id(f)][0])  # a write that raced the read: new mtime
            with self._lock:
                self.bytes_read += sum(r.length for r in chunk.reads)
        finally:
            for fd, _ in fds.values():
                os.close(fd)
        return None

    def _open(self, file: SafetensorsFile) -> tuple[int, bool]:
        try:
            fd = os.open(file.path, os.O_RDONLY)
        except OSError as e:
            file._check_unchanged()  # deleted or replaced since it was opened
            raise AdapterFileError(f"{file.path}: cannot be read ({e.strerror}); check its "
                                   "permissions") from None
        if not self.direct or not hasattr(os, "O_DIRECT") or \
                os.fstat(fd).st_dev in self._refused:
            return fd, False
        try:
            direct = os.open(file.path, os.O_RDONLY | os.O_DIRECT)
        except OSError:  # refused by the filesystem (tmpfs): buffered reads, same requests
            self._refused.add(os.fstat(fd).st_dev)
            return fd, False
        os.close(fd)
        return direct, True

    def _pread(self, fd: tuple[int, bool], buffer: torch.Tensor, r: _Read) -> None:
        view = memoryview((ctypes.c_ubyte * r.length).from_address(buffer.data_ptr() + r.at))
        got = 0
        while got < r.length:
            try:
                k = os.preadv(fd[0], [view[got:]], r.offset + got)
            except OSError as e:
                if fd[1] and e.errno == errno.EINVAL:
                    raise _DirectRefused from None
                raise AdapterFileError(f"{r.file.path}: reading failed ({e.strerror})") from None
            got += k
            if k < len(view) - (got - k):  # a regular file reads short only at its end
                break
        if got < r.need:
            raise FileChangedError(
                f"{r.file.path}: became shorter while a model streamed from it (it has fewer "
                f"bytes than its header describes); build the model again from the complete "
                "file, and keep checkpoint files unchanged while a model streams from them.")


def read_bandwidth(path: str | os.PathLike[str], nbytes: int = 2**30, *,
                   workers: int = _WORKERS, direct: bool = True) -> float:
    """Bytes per second reading the first ``nbytes`` of ``path`` (all of a smaller file) as the
    disk tier reads: ``O_DIRECT`` where the filesystem allows, 8 MiB pieces, ``workers`` of
    them in flight (its pool's size by default; more show what the device could give).

    The ceiling against which a model streaming from ``path``'s disk is measured (the demo and
    ``benchmarks/consumer.py``): one piece at a time reads an NVMe drive at a fraction of what
    a queue of several gives.

    Raises:
        AdapterFileError: ``path`` cannot be opened or read.
        ValueError: ``nbytes`` or ``workers`` below 1.
    """
    if nbytes < 1 or workers < 1:
        raise ValueError(f"nbytes={nbytes}, workers={workers}: both must be at least 1")
    try:
        size = os.stat(path).st_size
    except OSError as e:
        raise AdapterFileError(f"{path}: cannot be read ({e.strerror})") from None
    total = _round_up(min(nbytes, size), IO_ALIGN)  # O_DIRECT reads whole blocks
    pieces = [(at, min(_PIECE, total - at)) for at in range(0, total, _PIECE)]
    slots = torch.empty(workers * _PIECE + IO_ALIGN, dtype=torch.uint8)
    base = slots.data_ptr() + (-slots.data_ptr()) % IO_ALIGN
    local = threading.local()
    free = collections.deque(range(workers))  # each thread reads into a slot of its own

    def read(fd: int, piece: tuple[int, int]) -> int:
        if not hasattr(local, "at"):
            local.at = base + free.popleft() * _PIECE
        view = memoryview((ctypes.c_ubyte * piece[1]).from_address(local.at))
        return os.preadv(fd, [view], piece[0])

    def run(flags: int) -> tuple[int, float]:
        fd = os.open(path, flags)
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="shuttle-disk-probe") as pool:
                t0 = time.perf_counter()
                got = sum(pool.map(functools.partial(read, fd), pieces))
                return got, time.perf_counter() - t0
        finally:
            os.close(fd)

    try:
        if direct and hasattr(os, "O_DIRECT"):
            try:
                got, seconds = run(os.O_RDONLY | os.O_DIRECT)
            except OSError as e:  # refused at the open or the read (tmpfs): buffered instead
                if e.errno != errno.EINVAL:
                    raise
                local, free = threading.local(), collections.deque(range(workers))
                got, seconds = run(os.O_RDONLY)
        else:
            got, seconds = run(os.O_RDONLY)
    except OSError as e:
        raise AdapterFileError(f"{path}: reading failed ({e.strerror})") from None
    return got / max(seconds, 1e-9)


class _DirectRefused(Exception):
    """An O_DIRECT read was refused (EINVAL) by the filesystem: read buffered instead."""


class _Dropped(Exception):
    """The load was dropped with its pool (never waited for)."""
