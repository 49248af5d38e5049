"""Integration tests. ``host_peak``: the process's peak resident memory over a block."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


@contextlib.contextmanager
def host_peak() -> Iterator[dict[str, int]]:
    """Yield a dict whose ``"bytes"`` is set, at the block's end, to the process's peak resident
    memory inside the block above what was resident at its start (Linux only).

    Memory freed before the block goes back to the system first (``malloc_trim``), so the
    block cannot hide an allocation in pages that were freed but still resident; the kernel's
    peak (``VmHWM``) is then restarted from the resident size (``clear_refs``).
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS:")
    out = {"bytes": 0}
    yield out
    out["bytes"] = _status("VmHWM:") - base
