"""Write a safetensors file one tensor at a time: header first, then each tensor as it is made.

The header needs every tensor's dtype and shape, not its values, so a writer that is told them up
front can put the header down at once and stream the data after it: a merge of a 20 GB checkpoint
then holds one tensor in memory, not a shard. The layout is the one ``safetensors`` itself writes
(and :class:`~shuttle.formats.SafetensorsFile` reads): an 8-byte little-endian header length, the
JSON header padded with spaces to a multiple of 8 bytes, then the tensors back to back, larger
elements first so that every tensor starts aligned to its element size.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import torch

from shuttle.formats.safetensors_file import DTYPES

__all__ = ["SafetensorsWriter"]

_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class SafetensorsWriter:
    """A safetensors file written tensor by tensor, in :attr:`order`.

    Use as a context manager; leaving it normally checks that every tensor was written and
    flushes the file to disk (``fsync``), so a rename that follows publishes complete data.

    Args:
        path: the file to create (truncated if it exists).
        entries: tensor name -> ``(dtype, shape)`` of every tensor the file will hold.
        metadata: the ``__metadata__`` string map, if any.

    Attributes:
        order: the names in the order :meth:`write` must receive them (the data layout).
        nbytes: bytes of tensor data the file will hold.
    """

    def __init__(self, path: str | os.PathLike[str],
                 entries: Mapping[str, tuple[torch.dtype, Sequence[int]]],
                 metadata: Mapping[str, str] | None = None):
        # safetensors' data is little-endian; tensors are written as their raw memory.
        assert sys.byteorder == "little", "SafetensorsWriter needs a little-endian host"
        # Larger elements first (sorted() is stable, so file order otherwise): with an 8-aligned
        # data start every tensor then starts at a multiple of its element size.
        self.order = sorted(entries, key=lambda n: -_itemsize(entries[n][0]))
        self._specs = {n: (dtype, torch.Size(shape)) for n, (dtype, shape) in entries.items()}
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name in self.order:
            dtype, shape = self._specs[name]
            size = math.prod(shape) * _itemsize(dtype)
            header[name] = {"dtype": _NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        self.nbytes = offset
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 -- closed by close() / __exit__
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``'s bytes; ``name`` must be the next one in :attr:`order`."""
        assert self._next < len(self.order) and self.order[self._next] == name, (
            f"tensor {name!r} written out of order; expected "
            f"{self.order[self._next] if self._next < len(self.order) else 'none'}"
        )
        dtype, shape = self._specs[name]
        assert tensor.dtype == dtype and tensor.shape == shape, (
            f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}; the header says "
            f"{dtype} {tuple(shape)}"
        )
        t = tensor.detach().to("cpu").contiguous()
        size = t.numel() * t.element_size()
        if size:
            # A view of the tensor's memory (no copy, no numpy); ``t`` outlives the write.
            self._file.write((ctypes.c_ubyte * size).from_address(t.data_ptr()))
        self._next += 1

    def close(self) -> None:
        """Check every tensor was written, flush to disk and close."""
        assert self._next == len(self.order), (
            f"{self.path}: {len(self.order) - self._next} tensor(s) were never written"
        )
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()  # incomplete: the caller deletes the file
