"""Lazy safetensors access: the header is read and checked first, each tensor only when asked.

File layout: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the
header), then the data. The header is checked as the ``safetensors`` library checks it
(:mod:`~shuttle.formats.safetensors_header`) before any tensor is read, so a truncated file or a
header that lies about sizes fails at open, naming the key.

Tensors are read long after the open (at a merge), from a map of the file or with ``pread``. A
file rewritten in between would be read as other bytes, and one made shorter kills the process
with SIGBUS when a mapped page past its new end is touched. So the file's identity (device, inode,
size, modification time in ns) is recorded at open and compared before every read; a change
raises :class:`~shuttle.errors.FileChangedError` without touching the map. A change during the
short window between that check and the use of a mapped view is not caught.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from shuttle.errors import AdapterFileError, CorruptFileError, FileChangedError, ShuttleError
from shuttle.formats.safetensors_header import DTYPES, parse_header

__all__ = ["DTYPES", "LazyTensor", "SafetensorsFile"]

_MAX_HEADER = 100 * 2**20  # the safetensors format's own limit
_READ_PIECE = 16 * 2**20  # smallest piece a large read is split into
_CONVERT_PIECE = 16 * 2**20  # largest piece LazyTensor.load_converted reads at once
_READERS = max(1, min(8, os.cpu_count() or 1))


@functools.cache
def _reader_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_READERS, thread_name_prefix="shuttle-read")


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class LazyTensor:
    """One tensor of a :class:`SafetensorsFile`: shape and dtype now, data on :meth:`load`."""

    __slots__ = ("_file", "dtype", "key", "shape")

    def __init__(self, file: SafetensorsFile, key: str, dtype: torch.dtype, shape: torch.Size):
        self._file = file
        self.key = key
        self.dtype = dtype
        self.shape = shape

    def load(self, *, copy: bool = False) -> torch.Tensor:
        """Read the tensor: a copy-on-write view of the memory-mapped file, or with ``copy``
        memory of its own (see :meth:`SafetensorsFile.read`).
        """
        return self._file.read(self.key, copy=copy)

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    @property
    def path(self) -> Path:
        """The file the tensor lies in."""
        return self._file.path

    def load_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of the tensor (along its first dimension) in memory of their
        own, or read into the CPU ``uint8`` buffer ``out``, reading only their bytes (a rank's
        shard of a row-sharded weight, a fused weight's part).
        """
        return self._file.read_rows(self.key, start, stop, out)

    def load_into(self, out: torch.Tensor) -> torch.Tensor:
        """Read the tensor into the CPU ``uint8`` buffer ``out``; returns its typed view."""
        return self._file.read_into(self.key, out)

    def load_converted(self, out: torch.Tensor, rows: tuple[int, int] | None = None
                       ) -> torch.Tensor:
        """Read the tensor (or its rows ``[start, stop)`` along the first dimension) into
        ``out`` (a CPU tensor of that shape, any dtype), converted to ``out``'s dtype as
        ``copy_`` converts; returns ``out``.

        The rows are read a piece at a time, each piece into memory of its own of at most
        16 MiB (or one row, when a row is larger): the tensor never exists whole in its stored
        dtype beside ``out``.
        """
        start, stop = rows if rows is not None else (0, self.shape[0] if self.shape else 0)
        want = (stop - start, *self.shape[1:]) if rows is not None else tuple(self.shape)
        if tuple(out.shape) != want:
            raise ValueError(f"load_converted: out is {tuple(out.shape)}, {want} expected "
                             f"for {self.key!r}")
        if out.dim() == 0 or out.numel() == 0:
            return out.copy_(self.load(copy=True)) if rows is None else out
        step = max(1, _CONVERT_PIECE // max(1, self.nbytes // self.shape[0]))
        for a in range(start, stop, step):
            b = min(a + step, stop)
            out[a - start:b - start].copy_(self.load_rows(a, b))
        return out

    @property
    def file(self) -> SafetensorsFile:
        """The file the tensor lies in."""
        return self._file

    @property
    def offset(self) -> int:
        """Where the tensor's bytes start in the file (from the file's first byte)."""
        return self._file.data_start + self._file._entries[self.key][2]

    def __repr__(self) -> str:
        return f"LazyTensor({self.key!r}, {tuple(self.shape)}, {self.dtype})"


class SafetensorsFile:
    """A safetensors file opened by its header.

    Args:
        path: the file.

    Raises:
        AdapterFileError: the file does not exist or cannot be read.
        CorruptFileError: the file is truncated, or its header is refused (not valid JSON, a
            name given twice, an entry's dtype, shape or offsets inconsistent with each other or
            with the file size, bytes that belong to no tensor; see
            :mod:`~shuttle.formats.safetensors_header`).
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise AdapterFileError(f"{self.path}: no such file")
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())  # the identity of the very file the header comes from
                self.size = st.st_size
                raw = self._read_header(f)
        except AdapterFileError:  # CorruptFileError is an OSError too
            raise
        except OSError as e:
            raise AdapterFileError(f"{self.path}: cannot be read ({e.strerror}); check its "
                                   "permissions") from None
        self._identity = _identity(st)
        self.data_start = 8 + len(raw)
        self.metadata, self._entries = parse_header(raw, self.size - self.data_start, self.path)
        self._mmap: mmap.mmap | None = None

    def _corrupt(self, what: str) -> CorruptFileError:
        return CorruptFileError(
            f"{self.path}: {what}. The file is truncated or corrupt; download or export it again."
        )

    def _read_header(self, f) -> bytes:
        if self.size < 8:
            raise self._corrupt(f"only {self.size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER or 8 + n > self.size:
            raise self._corrupt(
                f"header claims {n} bytes but the file has {self.size - 8} after the length"
            )
        raw = f.read(n)
        if len(raw) != n:
            raise self._corrupt(f"it ended {n - len(raw)} bytes early while reading the header")
        return raw

    def _check_unchanged(self, fd: int | None = None) -> None:
        """Raise FileChangedError unless the file (``fd``'s, else the one at the path) is the
        one opened: same device, inode, size and modification time.
        """
        try:
            st = os.fstat(fd) if fd is not None else os.stat(self.path)
        except OSError as e:
            raise FileChangedError(
                f"{self.path}: can no longer be read ({e.strerror}); it was opened (loaded) "
                "earlier and its tensors are read only when needed. Restore the file, or load "
                "it again from where it is now."
            ) from None
        now = _identity(st)
        if now == self._identity:
            return
        dev, ino, size, mtime = self._identity
        if (now[0], now[1]) != (dev, ino):
            what = "was replaced by another file"
        elif now[2] != size:
            what = f"was rewritten ({size} bytes when opened, {now[2]} now)"
        else:
            what = "was rewritten (its modification time changed)"
        raise FileChangedError(
            f"{self.path}: {what} after it was opened (loaded); its tensors are read only when "
            "needed, and reading them now would give other bytes than the header describes "
            "(or crash on a shorter file). Load it again (shuttle.load_lora) to use the new "
            "contents, and keep adapter files unchanged while they are loaded."
        )

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        """Tensor names in header order."""
        return list(self._entries)

    def tensor_ref(self, key: str) -> LazyTensor:
        """A :class:`LazyTensor` for ``key``."""
        dtype, shape, _, _ = self._entries[key]
        return LazyTensor(self, key, dtype, shape)

    def read(self, key: str, *, copy: bool = False) -> torch.Tensor:
        """Read one tensor; its storage is a private copy-on-write map of the file.

        Args:
            key: the tensor's name.
            copy: read into memory of its own instead (``readinto``, no map). For streaming a
                large file: every page of the map that was touched counts towards the process's
                resident memory until the file is closed, so reading a 20 GB checkpoint through
                it leaves the process 20 GB large; a copy is freed when dropped.
        """
        dtype, shape, begin, end = self._entries[key]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        if copy:
            return self._read_copy(begin, end).view(dtype).reshape(shape)
        # Before the map is touched: a page past the end of a file made shorter raises SIGBUS.
        self._check_unchanged()
        if self._mmap is None:
            self._mmap = self._map()
        flat = torch.frombuffer(
            self._mmap, dtype=torch.uint8, count=end - begin, offset=self.data_start + begin
        )
        if (self.data_start + begin) % flat.new_empty((), dtype=dtype).element_size():
            flat = flat.clone()  # unaligned offset: a dtype view needs an aligned start
        return flat.view(dtype).reshape(shape)

    def read_rows(self, key: str, start: int, stop: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``key`` (its first dimension), read into memory of
        their own, or into ``out`` (a CPU ``uint8`` buffer of at least their size; the typed
        view of it is returned): the bytes of those rows only (a row-major tensor keeps them
        together).

        Raises:
            ShuttleError: ``[start, stop)`` is not a row range of the tensor (or it is 0-d).
        """
        dtype, shape, begin, end = self._entries[key]
        if len(shape) == 0 or not 0 <= start <= stop <= shape[0]:
            raise ShuttleError(f"{self.path}: rows [{start}, {stop}) of {key!r} (shape "
                               f"{tuple(shape)}) are not a row range of it")
        row = (end - begin) // shape[0] if shape[0] else 0
        part = (stop - start,) + tuple(shape[1:])
        n = (stop - start) * row
        if out is not None and (out.dtype != torch.uint8 or out.device.type != "cpu"
                                or out.numel() < n):
            raise ValueError(f"read_rows: out must be a CPU uint8 buffer of at least {n} "
                             f"bytes, got {out.dtype} {tuple(out.shape)}")
        if row == 0 or stop == start:
            empty = torch.empty(0, dtype=torch.uint8) if out is None else out[:0]
            return empty.view(dtype).reshape(part)
        raw = self._read_copy(begin + start * row, begin + stop * row,
                              None if out is None else out[:n])
        return raw.view(dtype).reshape(part)

    def _map(self) -> mmap.mmap:
        try:
            with open(self.path, "rb") as f:
                self._check_unchanged(f.fileno())  # the file mapped is the one opened
                return mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_COPY)
        except FileChangedError:
            raise
        except (OSError, ValueError) as e:  # ValueError: shorter than size since the check
            self._check_unchanged()
            raise AdapterFileError(f"{self.path}: cannot be mapped ({e})") from None

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """Read one tensor into ``out`` (a CPU ``uint8`` buffer of at least its size, e.g. a
        pinned staging buffer reused across tensors); returns the typed view of ``out``.
        """
        dtype, shape, begin, end = self._entries[key]
        if out.dtype != torch.uint8 or out.device.type != "cpu" or out.numel() < end - begin:
            raise ValueError(f"read_into: out must be a CPU uint8 buffer of at least "
                             f"{end - begin} bytes, got {out.dtype} {tuple(out.shape)}")
        return self._read_copy(begin, end, out[:end - begin]).view(dtype).reshape(shape)

    def _pread(self, fd: int, view: memoryview, offset: int) -> None:
        got = 0
        while got < len(view):  # one read returns at most ~2 GiB on Linux
            k = os.preadv(fd, [view[got:]], offset + got)
            if not k:  # its size was checked: it was made shorter while being read
                raise FileChangedError(
                    f"{self.path}: became shorter while a tensor was read from it; load it "
                    "again (shuttle.load_lora) once it is complete, and keep adapter files "
                    "unchanged while they are loaded.")
            got += k

    def _read_copy(self, begin: int, end: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        n = end - begin
        if raw is None:
            raw = torch.empty(n, dtype=torch.uint8)  # 64-byte aligned: any dtype view is valid
        if n == 0:
            return raw
        # preadv needs a writable buffer; ctypes gives one over the tensor's memory without
        # numpy (an optional dependency).
        view = memoryview((ctypes.c_ubyte * n).from_address(raw.data_ptr())).cast("B")
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            self._check_unchanged()  # deleted or replaced since the open
            raise AdapterFileError(f"{self.path}: cannot be read ({e.strerror}); check its "
                                   "permissions") from None
        try:
            self._check_unchanged(fd)
            # A large tensor is read in a few contiguous pieces at once: one thread copies
            # from the page cache at ~5 GB/s, several at the memory's speed. preadv releases
            # the GIL and takes an offset, so the threads share the descriptor.
            step = max(_READ_PIECE, -(-n // _READERS))
            pieces = [(o, min(o + step, n)) for o in range(0, n, step)]
            start = self.data_start + begin
            if len(pieces) == 1:
                self._pread(fd, view, start)
            else:
                # Every piece ends before fd is closed: its number could be reused by then.
                done, _ = wait([_reader_pool().submit(self._pread, fd, view[a:b], start + a)
                                for a, b in pieces])
                for f in done:
                    f.result()
            self._check_unchanged(fd)  # a write that raced the read leaves a new mtime
        finally:
            os.close(fd)
        return raw
