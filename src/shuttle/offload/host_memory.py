"""How much host memory this process can still take before the system swaps or kills it.

The kernel's estimate of memory available without swapping (``MemAvailable`` in
``/proc/meminfo``: free memory plus the page cache and other memory it can reclaim), within the
limit of the cgroup the process runs in, where it has one (containers, Slurm jobs, systemd
slices: their limit is not in ``/proc/meminfo``). A cgroup's room is its limit less what it
uses, page cache it could drop (``inactive_file``) not counted as used; the tightest of the
process's cgroup and its ancestors wins.

Pinned memory is page-locked and never reclaimed, so a model pinned past this number ends in
the out-of-memory killer, not in an error: :func:`shuttle.integrations.budgets.byte_budgets`
reads it for ``max_host_bytes="auto"`` and refuses a load without a ceiling that would not fit.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["HOST_RESERVE", "available_host_bytes"]

# What the process needs beside the weights it holds: CUDA's context, the libraries (torch,
# diffusers and transformers take about 1 GB resident), staging for files, activations made on
# the host. max_host_bytes bounds shuttle's bytes; the process's peak RSS is about this more.
HOST_RESERVE = 2 * 2**30


def available_host_bytes(root: str | os.PathLike[str] = "/") -> int | None:
    """Bytes of host memory this process can still take, or None where the system does not say
    (no ``/proc/meminfo``: not Linux).

    Args:
        root: where ``/proc`` and ``/sys`` are found (tests give a folder laid out like them).
    """
    root = Path(root)
    try:
        meminfo = (root / "proc/meminfo").read_text()
    except OSError:
        return None
    fields = _fields(meminfo, unit=1024)  # "MemAvailable:  123456 kB"
    available = fields.get("MemAvailable", fields.get("MemFree"))
    if available is None:
        return None
    for room in _cgroup_rooms(root):
        available = min(available, room)
    return max(0, available)


def _fields(text: str, unit: int = 1) -> dict[str, int]:
    """``name value`` or ``name: value [kB]`` lines as ints (times ``unit``)."""
    out = {}
    for line in text.splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1]) * unit
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_rooms(root: Path) -> list[int]:
    """Room left under each memory limit of the process's cgroup and its ancestors."""
    rooms = []
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":  # cgroup v2: one unified hierarchy
            base, limit, usage = root / "sys/fs/cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # cgroup v1's memory controller
            base = root / "sys/fs/cgroup/memory"
            limit, usage = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        folder = base / path.lstrip("/")
        while True:
            room = _room(folder, limit, usage)
            if room is not None:
                rooms.append(room)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return rooms


def _room(folder: Path, limit_file: str, usage_file: str) -> int | None:
    limit, usage = _read(folder / limit_file), _read(folder / usage_file)
    if limit is None or usage is None or not limit.isdigit() or not usage.isdigit():
        return None  # "max" (no limit) or no such cgroup folder in this namespace
    # (cgroup v1 writes "no limit" as a number near 2**63: never the smallest room)
    reclaimable = _fields(_read(folder / "memory.stat") or "").get("inactive_file", 0)
    return int(limit) - max(0, int(usage) - reclaimable)
