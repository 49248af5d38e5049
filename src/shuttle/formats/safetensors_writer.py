"""Write a safetensors file one tensor at a time: header first, then each tensor as it is made.

The header needs every tensor's dtype and shape, not its values, so a writer that is told them up
front can put the header down at once and stream the data after it: a merge of a 20 GB checkpoint
then holds one tensor in memory, not a shard. The layout is the one ``safetensors`` itself writes
(and :class:`~shuttle.formats.SafetensorsFile` reads): an 8-byte little-endian header length, the
JSON header padded with spaces to a multiple of 8 bytes, then the tensors back to back, larger
elements first so that every tensor starts aligned to its element size.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import shutil
import struct
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import torch

from shuttle.errors import AdapterFileError
from shuttle.formats.safetensors_file import DTYPES

__all__ = ["TEMP_PREFIX", "SafetensorsWriter", "create_temp", "publish_mode", "staged_folder",
           "remove_stale_temps"]

# Every temporary file shuttle writes beside an output starts with this, so that one a killed
# process left behind (SIGKILL, power loss) can be found and removed by a later run.
TEMP_PREFIX = ".shuttle-partial."

_NAMES = {dtype: name for name, dtype in DTYPES.items()}


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
        self.order = sorted(entries, key=lambda n: -entries[n][0].itemsize)
        self._specs = {n: (dtype, torch.Size(shape)) for n, (dtype, shape) in entries.items()}
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name in self.order:
            dtype, shape = self._specs[name]
            size = math.prod(shape) * dtype.itemsize
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


@contextlib.contextmanager
def staged_folder(source: Path, out: Path, overwrite: bool) -> Iterator[Path]:
    """The folder to write a copy of the folder ``source`` into: published as ``out`` when the
    block ends normally (replacing it, with ``overwrite``), removed otherwise, so that ``out``
    appears complete or not at all.

    Raises:
        AdapterFileError: ``out`` is ``source`` or inside it, exists (without ``overwrite``),
            or is a file.
    """
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise AdapterFileError(f"{out} is {source} or inside it; write the copy elsewhere")
    if out.exists() and not overwrite:
        raise AdapterFileError(f"{out} exists; pass overwrite=True (`--force`) to replace it")
    if out.exists() and not out.is_dir():
        raise AdapterFileError(f"{out} is a file; the copy of a folder is a folder: name another")
    part = out.parent / f".{out.name}.part"
    shutil.rmtree(part, ignore_errors=True)
    try:
        part.mkdir(parents=True)
        yield part
        if out.exists():
            shutil.rmtree(out)
        part.rename(out)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise


def create_temp(final: str | os.PathLike[str]) -> Path:
    """Create an empty temporary file beside ``final``, to be renamed onto it when complete.

    Named ``.shuttle-partial.<final name>.<token><final suffix>`` (the suffix kept, as readers
    choose a format by it) and created as ``open()`` creates files: mode 0666 less the umask, so
    the published file gets the permissions of any other new file (0644 under umask 022).
    """
    final = Path(final)
    while True:
        tmp = final.with_name(f"{TEMP_PREFIX}{final.name}.{uuid.uuid4().hex[:8]}{final.suffix}")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:
            continue


def publish_mode(path: str | os.PathLike[str]) -> None:
    """Give ``path`` the mode a new file gets (0666 less the umask); for files that a library
    created 0600 (``safetensors.torch.save_file``).
    """
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask() sets it, racing other threads)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove_stale_temps(directory: str | os.PathLike[str], older_than_hours: float = 24.0
                       ) -> list[Path]:
    """Delete temporary files (:data:`TEMP_PREFIX`) in ``directory`` not modified for
    ``older_than_hours``: ones a killed run left. A younger one may belong to a run in progress
    and is kept. Returns the paths removed; files that vanish or cannot be removed are skipped.
    """
    cutoff = time.time() - older_than_hours * 3600
    removed = []
    try:
        candidates = [p for p in Path(directory).iterdir() if p.name.startswith(TEMP_PREFIX)]
    except OSError:
        return removed
    for p in candidates:
        try:
            if p.is_file() and not p.is_symlink() and p.stat().st_mtime < cutoff:
                p.unlink()
                removed.append(p)
        except OSError:
            continue
    return removed
