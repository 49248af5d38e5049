"""A safetensors file whose tensors are made one at a time, before all their shapes are known.

A safetensors header lists every tensor's shape before the data, so a writer that learns shapes
as it goes (an extraction learns each rank only after its SVD) cannot stream straight into the
file. :class:`SafetensorsSpool` appends each tensor's bytes to an anonymous temporary file as it
arrives, so memory holds one tensor at a time; :meth:`SafetensorsSpool.publish` then writes the
real file under a temporary name beside the target, lets the caller check it, and renames it into
place, so an existing file is replaced only by a complete, checked one.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import torch

from shuttle.formats.safetensors_writer import SafetensorsWriter, create_temp

__all__ = ["SafetensorsSpool"]


class SafetensorsSpool:
    """Tensors spooled to disk as they are made, then published as one safetensors file.

    Use as a context manager (or call :meth:`close`): the spool is deleted when closed, whether
    or not it was published.

    Args:
        directory: where the spool and the published file's temporary name live; the directory
            of the final file, so that the closing rename stays on one filesystem.
    """

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)
        self._file: BinaryIO = tempfile.TemporaryFile(dir=self.directory)  # noqa: SIM115
        # key -> (dtype, shape, offset in the spool, bytes)
        self.entries: dict[str, tuple[torch.dtype, torch.Size, int, int]] = {}

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (copied to the CPU) under ``key``; each key once."""
        assert key not in self.entries, f"key {key!r} added twice"
        t = tensor.detach().cpu().contiguous()
        size = t.numel() * t.element_size()
        self._file.seek(0, os.SEEK_END)
        offset = self._file.tell()
        if size:
            # The tensor's memory as a buffer (no numpy: it is not a dependency of shuttle).
            self._file.write((ctypes.c_ubyte * size).from_address(t.data_ptr()))
        self.entries[key] = (t.dtype, t.shape, offset, size)

    def read(self, key: str) -> torch.Tensor:
        """The tensor added under ``key``, read back into memory of its own."""
        dtype, shape, offset, size = self.entries[key]
        raw = torch.empty(size, dtype=torch.uint8)
        if size:
            self._file.seek(offset)
            view = memoryview((ctypes.c_ubyte * size).from_address(raw.data_ptr())).cast("B")
            got = 0
            while got < size:  # one read returns at most ~2 GiB on Linux
                n = self._file.readinto(view[got:])
                assert n, f"spool ended {size - got} bytes early reading {key!r}"
                got += n
        return raw.view(dtype).reshape(shape)

    def publish(self, path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None,
                check: Callable[[Path], None] | None = None) -> Path:
        """Write every added tensor to ``path``, atomically.

        Args:
            path: the file to create or replace; in :attr:`directory`, named ``*.safetensors``
                so that the temporary file is too (readers pick formats by suffix).
            metadata: the ``__metadata__`` string map.
            check: called with the complete temporary file before the rename; an exception it
                raises stops the publish.

        Returns:
            ``path``.

        Raises:
            Whatever writing or ``check`` raises; the temporary file is removed and an existing
            ``path`` is left as it was.
        """
        path = Path(path)
        tmp = create_temp(path)  # mode 0666 less the umask, as merge's outputs
        try:
            entries = {k: (dtype, shape) for k, (dtype, shape, _, _) in self.entries.items()}
            with SafetensorsWriter(tmp, entries, metadata) as w:
                for key in w.order:
                    w.write(key, self.read(key))
            if check is not None:
                check(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    def close(self) -> None:
        """Delete the spool."""
        self._file.close()

    def __enter__(self) -> SafetensorsSpool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
