"""Capturing pageable weights into pinned host arenas: which way is fast, GB/s.

24 units of 336 MiB (Flux-block sized; 12 tensors each) copied from pageable tensors into fresh
arenas, then page-locked, in several ways: plain allocations or transparent-huge-page maps,
registering before or after the copy, one thread or several, and PyTorch's pinned allocator.
shuttle's HostStorage uses huge-page maps, copy first, then register, 4 threads.

Run on the GPU machine: ``python benchmarks/offload_capture.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import mmap
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

PAGE, HUGE = 4096, 2 * 2**20
UNITS, PER_UNIT, TENSORS = 24, 336 * 2**20, 12


def sources():
    pool = torch.randn(2**26).bfloat16()
    out = []
    for u in range(UNITS):
        ts = []
        n = PER_UNIT // TENSORS // 2
        for j in range(TENSORS):
            t = torch.empty(n, dtype=torch.bfloat16)
            t.copy_(pool[(u * 7 + j) * 1000: (u * 7 + j) * 1000 + n])
            ts.append(t)
        out.append(ts)
    return out


def register(ptr: int, size: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    assert int(err) == 0, err


def alloc_empty(size: int):
    raw = torch.empty(size + PAGE, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % PAGE
    return raw, raw[shift:shift + size]


def alloc_huge(size: int):
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(m, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % HUGE
    return (m, raw), raw[shift:shift + size]


def copy_in(arena, ts):
    off = 0
    for t in ts:
        nb = t.numel() * 2
        arena[off:off + nb].view(torch.bfloat16).copy_(t)
        off += nb


RESULTS: dict[str, dict[str, float]] = {}


def variant(name, srcs, alloc, order, threads=1):
    keep = []

    def one(ts):
        size = sum(t.numel() * 2 for t in ts)
        owner, arena = alloc(size)
        if order == "register_first":
            register(arena.data_ptr(), size)
            copy_in(arena, ts)
        elif order == "copy_first":
            copy_in(arena, ts)
            register(arena.data_ptr(), size)
        else:  # torch pinned allocator
            copy_in(arena, ts)
        return owner, arena

    t0 = time.perf_counter()
    if threads == 1:
        keep = [one(ts) for ts in srcs]
    else:
        with cf.ThreadPoolExecutor(threads) as ex:
            keep = list(ex.map(one, srcs))
    dt = time.perf_counter() - t0
    total = UNITS * PER_UNIT
    print(f"{name:40s} {dt:6.2f} s  {total / dt / 1e9:6.2f} GB/s", flush=True)
    RESULTS[name] = {"seconds": dt, "gb_per_s": total / dt / 1e9}
    for _owner, arena in keep:
        if order != "pinned_alloc":
            torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())
    del keep


def alloc_pinned(size: int):
    t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    return t, t


def main() -> None:
    torch.cuda.init()
    srcs = sources()
    print(f"{UNITS} units x {PER_UNIT / 2**20:.0f} MiB; threads={torch.get_num_threads()}")
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for name, alloc, order, th in [
        ("empty+register_first (shuttle before)", alloc_empty, "register_first", 1),
        ("empty+copy_first", alloc_empty, "copy_first", 1),
        ("huge+register_first", alloc_huge, "register_first", 1),
        ("huge+copy_first", alloc_huge, "copy_first", 1),
        ("empty+register_first x4 threads", alloc_empty, "register_first", 4),
        ("huge+register_first x4 threads", alloc_huge, "register_first", 4),
        ("huge+copy_first x4 threads", alloc_huge, "copy_first", 4),
        ("huge+copy_first x8 threads", alloc_huge, "copy_first", 8),
        ("torch pin_memory allocator", alloc_pinned, "pinned_alloc", 1),
        ("empty+register_first (again)", alloc_empty, "register_first", 1),
    ]:
        try:
            variant(name, srcs, alloc, order, th)
        except Exception as e:  # noqa: BLE001 - a way that fails here is reported, not fatal
            print(name, "failed:", e, flush=True)
    rows = [[k, f"{v['seconds']:.2f}", f"{v['gb_per_s']:.2f}"] for k, v in RESULTS.items()]
    table = harness.markdown_table(["way", "seconds", "GB/s"], rows)
    harness.write_results("offload_capture", {"results": RESULTS, "units": UNITS,
                                              "unit_bytes": PER_UNIT}, table,
                          "Capturing weights into pinned arenas (benchmarks/offload_capture.py)",
                          f"{UNITS} units of {PER_UNIT / 2**20:.0f} MiB "
                          f"({UNITS * PER_UNIT / 1e9:.1f} GB), {TENSORS} tensors each.")
    print(table)


if __name__ == "__main__":
    main()
