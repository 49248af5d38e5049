"""Lazy safetensors access: the header is read and checked first, each tensor only when asked.

File layout: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the
header), then the data. Every entry is checked against the file's size before any tensor is read,
so a truncated file or a header that lies about sizes fails at open, naming the key.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from shuttle.errors import AdapterFileError, CorruptFileError

__all__ = ["DTYPES", "LazyTensor", "SafetensorsFile"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 2**20  # the safetensors format's own limit
_READ_PIECE = 16 * 2**20  # smallest piece a large read is split into
_READERS = max(1, min(8, os.cpu_count() or 1))


@functools.cache
def _reader_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_READERS, thread_name_prefix="shuttle-read")


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

    def load_into(self, out: torch.Tensor) -> torch.Tensor:
        """Read the tensor into the CPU ``uint8`` buffer ``out``; returns its typed view."""
        return self._file.read_into(self.key, out)

    def __repr__(self) -> str:
        return f"LazyTensor({self.key!r}, {tuple(self.shape)}, {self.dtype})"


class SafetensorsFile:
    """A safetensors file opened by its header.

    Args:
        path: the file.

    Raises:
        AdapterFileError: the file does not exist.
        CorruptFileError: the file is truncated, its header is not valid JSON, or an entry's
            dtype, shape or offsets are inconsistent with each other or with the file size.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise AdapterFileError(f"{self.path}: no such file")
        self.size = self.path.stat().st_size
        header, self.data_start = self._read_header()
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise self._corrupt("__metadata__ is not a JSON object")
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()}
        self._entries: dict[str, tuple[torch.dtype, torch.Size, int, int]] = {}
        data_size = self.size - self.data_start
        spans = []
        for key, entry in header.items():
            dtype, shape, begin, end = self._parse_entry(key, entry, data_size)
            self._entries[key] = (dtype, shape, begin, end)
            spans.append((begin, end, key))
        spans.sort()
        for (_, end_a, key_a), (begin_b, end_b, key_b) in zip(spans, spans[1:], strict=False):
            if begin_b < end_a and end_b > begin_b:
                raise self._corrupt(f"tensors {key_a!r} and {key_b!r} overlap in the data")
        self._mmap: mmap.mmap | None = None

    def _corrupt(self, what: str) -> CorruptFileError:
        return CorruptFileError(
            f"{self.path}: {what}. The file is truncated or corrupt; download or export it again."
        )

    def _read_header(self) -> tuple[dict, int]:
        if self.size < 8:
            raise self._corrupt(f"only {self.size} bytes, shorter than the 8-byte header length")
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER or 8 + n > self.size:
                raise self._corrupt(
                    f"header claims {n} bytes but the file has {self.size - 8} after the length"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise self._corrupt(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._corrupt("header is not a JSON object")
        return header, 8 + n

    def _parse_entry(self, key: str, entry: object, data_size: int):
        if not isinstance(entry, dict):
            raise self._corrupt(f"entry {key!r} is not an object")
        name = entry.get("dtype")
        dtype = DTYPES.get(name) if isinstance(name, str) else None  # a list is unhashable
        if dtype is None:
            raise self._corrupt(f"tensor {key!r} has unknown dtype {entry.get('dtype')!r}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise self._corrupt(f"tensor {key!r} has an invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets)):
            raise self._corrupt(f"tensor {key!r} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= data_size:
            raise self._corrupt(
                f"tensor {key!r} spans bytes {begin}..{end} but the data section has {data_size}"
            )
        if end - begin != nbytes:
            raise self._corrupt(
                f"tensor {key!r} of shape {shape} and dtype {entry['dtype']} needs {nbytes} bytes "
                f"but its offsets span {end - begin}"
            )
        return dtype, torch.Size(shape), begin, end

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
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(
            self._mmap, dtype=torch.uint8, count=end - begin, offset=self.data_start + begin
        )
        if (self.data_start + begin) % flat.new_empty((), dtype=dtype).element_size():
            flat = flat.clone()  # unaligned offset: a dtype view needs an aligned start
        return flat.view(dtype).reshape(shape)

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
            if not k:
                raise self._corrupt(f"it ended {len(view) - got} bytes early while reading")
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
        fd = os.open(self.path, os.O_RDONLY)
        try:
            # A large tensor is read in a few contiguous pieces at once: one thread copies
            # from the page cache at ~5 GB/s, several at the memory's speed. preadv releases
            # the GIL and takes an offset, so the threads share the descriptor.
            step = max(_READ_PIECE, -(-n // _READERS))
            pieces = [(o, min(o + step, n)) for o in range(0, n, step)]
            start = self.data_start + begin
            if len(pieces) == 1:
                self._pread(fd, view, start)
            else:
                for f in [_reader_pool().submit(self._pread, fd, view[a:b], start + a)
                          for a, b in pieces]:
                    f.result()
        finally:
            os.close(fd)
        return raw
