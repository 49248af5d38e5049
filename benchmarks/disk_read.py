"""Reading weights from disk: the disk tier's reads against kvikio's and a plain read, one
interleaved run on the same drive.

Every variant reads ``--gib`` GiB of a file of its own, written fresh for each round with
O_DIRECT (never in the page cache; the cache is also told to drop it), random bytes, so that no
read is served by a cache a reread would hit:

    buffered        one ``readinto`` after another, 8 MiB at a time (what a plain load does)
    shuttle xN      ``shuttle.offload.disk_reader.read_bandwidth``: O_DIRECT, 8 MiB pieces, N
                    in flight, into host memory (the disk tier reads with 4)
    tier -> cuda    the disk tier itself: units of ``--unit-mib`` read by a ``DiskReader``
                    into two pinned staging buffers and copied from there into device slots on
                    a copy stream, reads overlapping copies (``tier -> cpu`` without CUDA:
                    the CPU copy path, copies synchronous)
    kvikio host xN  ``kvikio.CuFile.pread`` into pinned host memory, N threads
    kvikio GPU xN   the same into device memory (GPUDirect Storage where the machine has it,
                    else kvikio's own bounce buffers)

kvikio variants run only where it is installed (``pip install kvikio-cu13``), with
``auto_direct_io_read`` on where its version has it. Time: wall clock from the first request to
the last byte (on the device: after a synchronization), median of ``--rounds`` rounds, each
round in its own order; rates in GB/s (1e9 bytes).

    PYTHONPATH=src python benchmarks/disk_read.py --folder /tmp/disk-read      # the GPU run
    PYTHONPATH=src python benchmarks/disk_read.py --smoke --folder /tmp/dr     # on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from shuttle.formats.safetensors_file import SafetensorsFile  # noqa: E402
from shuttle.offload.arena import new_arena, register_pages  # noqa: E402
from shuttle.offload.disk_reader import (  # noqa: E402
    IO_ALIGN,
    DiskReader,
    DiskSpans,
    read_bandwidth,
)

MIB = 2**20
PIECE = 8 * MIB
Reader = Callable[[Path, int], float]  # (file, bytes to read) -> bytes per second


def aligned(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A CPU ``uint8`` buffer of ``nbytes`` at an ``IO_ALIGN``-aligned address, allocated as
    the disk tier allocates its staging buffers (an arena; with ``pin``, its pages locked)."""
    buf = new_arena(nbytes, pin=True)[:nbytes]  # pin=True: page-aligned
    if pin:
        register_pages(buf, [])
    return buf


def write_file(path: Path, nbytes: int, unit: int, pool: torch.Tensor, buf: torch.Tensor,
               salt: int) -> None:
    """``nbytes`` of random bytes at ``path`` as safetensors tensors ``u0``, ``u1``, ... of
    ``unit`` bytes each (uint8; the header padded so that the data starts at 4 KiB, every
    tensor block-aligned), written past the page cache through ``buf`` (an aligned buffer of
    ``pool``'s bytes: ``pool`` plus a salt, fresh bytes per piece and file)."""
    entries = ",".join(f'"u{i}":{{"dtype":"U8","shape":[{min(unit, nbytes - at)}],'
                       f'"data_offsets":[{at},{min(at + unit, nbytes)}]}}'
                       for i, at in enumerate(range(0, nbytes, unit)))
    header = ("{" + entries + "}").encode()
    assert len(header) <= IO_ALIGN - 8, "too many units for a one-block header"
    header += b" " * (IO_ALIGN - 8 - len(header))
    words = buf.view(torch.int64)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0))
        direct = hasattr(os, "O_DIRECT")
    except OSError:  # tmpfs: buffered, then dropped from the cache below
        fd, direct = os.open(path, flags), False
    try:
        head = buf[:IO_ALIGN]
        head.copy_(torch.frombuffer(bytearray(len(header).to_bytes(8, "little") + header),
                                    dtype=torch.uint8))
        os.pwrite(fd, memoryview(head.numpy()), 0)
        at = 0
        while at < nbytes:
            torch.add(pool, salt * 1_000_003 + at, out=words)
            n = min(words.numel() * 8, nbytes - at)
            os.pwrite(fd, memoryview(buf[:n].numpy()), IO_ALIGN + at)
            at += n
        os.fsync(fd)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_buffered(path: Path, nbytes: int) -> float:
    buf = bytearray(PIECE)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        f.seek(IO_ALIGN)
        got = 0
        while got < nbytes:
            k = f.readinto(view[:min(PIECE, nbytes - got)])
            if not k:
                break
            got += k
    return got / (time.perf_counter() - t0)


def tier_reader(unit: int, device: torch.device) -> Reader:
    """The disk tier's path to the device: each ``unit`` bytes of the file one load of a
    ``DiskReader`` with two pinned staging buffers, its copies into two device slots on a copy
    stream, the reader told when a staging buffer's copies ran by its event (as the slot pool
    does). On the CPU the copies are synchronous, as the tier's CPU copy path makes them."""
    cuda = device.type == "cuda"
    reader = DiskReader()
    reader.set_buffers([aligned(unit, pin=cuda) for _ in range(2)], cuda=cuda)
    slots = [torch.empty(unit, dtype=torch.uint8, device=device) for _ in range(2)]
    stream = torch.cuda.Stream(device) if cuda else None

    def run(path: Path, nbytes: int) -> float:
        file = SafetensorsFile(path)
        loads = []
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for i in range(-(-nbytes // unit)):
            slot = slots[i % 2]
            spans = DiskSpans([(0, file.tensor_ref(f"u{i}"))])

            def land(buffer, copies, first, last, staged, slot=slot):
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                    for c in copies:
                        slot[c.to:c.to + c.n].copy_(buffer[c.at:c.at + c.n], non_blocking=cuda)
                    if staged is not None:
                        staged.record(stream)

            loads.append(reader.submit(slot, spans, land))
            if len(loads) > 2:
                reader.finish(loads.pop(0))
        for load in loads:
            reader.finish(load)
        if cuda:
            torch.cuda.synchronize(device)
        return nbytes / (time.perf_counter() - t0)

    return run


def kvikio_reader(device: torch.device
                  ) -> tuple[Callable[[int, torch.Tensor], Reader] | None, dict[str, object]]:
    """A maker of kvikio readers (threads, destination) and kvikio's settings; None where it is
    not installed, or without CUDA (its reads load CUDA's driver even into host memory)."""
    if device.type != "cuda":
        return None, {}
    try:
        import kvikio
        import kvikio.defaults
    except ImportError:
        return None, {}
    settings: dict[str, object] = {"version": kvikio.__version__}
    with contextlib.suppress(Exception):  # a version without it reads through the page cache
        kvikio.defaults.set("auto_direct_io_read", True)
    for key in ("compat_mode", "auto_direct_io_read", "task_size", "bounce_buffer_size"):
        with contextlib.suppress(Exception):
            settings[key] = str(kvikio.defaults.get(key))

    def reader(threads: int, out: torch.Tensor) -> Reader:
        def run(path: Path, nbytes: int) -> float:
            kvikio.defaults.set("num_threads", threads)
            target = out[:nbytes]
            buf = target if target.is_cuda else target.numpy()  # kvikio: CUDA array or buffer
            with kvikio.CuFile(path, "r") as f:
                if target.is_cuda:
                    torch.cuda.synchronize(target.device)
                t0 = time.perf_counter()
                got = f.pread(buf, nbytes, IO_ALIGN).get()
                if target.is_cuda:
                    torch.cuda.synchronize(target.device)
            assert got == nbytes, (got, nbytes)
            return nbytes / (time.perf_counter() - t0)
        return run

    return reader, settings


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", type=Path, required=True, help="on the drive to measure")
    p.add_argument("--gib", type=float, default=2.0, help="GiB each read")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--unit-mib", type=int, default=256, help="the tier's unit (a block)")
    p.add_argument("--smoke", action="store_true",
                   help="a few MiB, results printed, not written")
    args = p.parse_args(argv)
    nbytes = 8 * MIB if args.smoke else int(args.gib * 2**30) // IO_ALIGN * IO_ALIGN
    unit = 2 * MIB if args.smoke else args.unit_mib * MIB
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    variants: dict[str, Reader] = {"buffered": read_buffered}
    for n in (1, 4, 16):
        variants[f"shuttle x{n}"] = (
            lambda path, nbytes, n=n: read_bandwidth(path, nbytes + IO_ALIGN, workers=n))
    variants[f"tier -> {device.type}"] = tier_reader(unit, device)
    kvikio, settings = kvikio_reader(device)
    if kvikio is not None:
        host = aligned(nbytes, pin=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for n in (4, 16):
            variants[f"kvikio host x{n}"] = kvikio(n, host)
            variants[f"kvikio GPU x{n}"] = kvikio(n, dev)

    args.folder.mkdir(parents=True, exist_ok=True)
    pool = torch.randint(-2**62, 2**62, (min(nbytes, 64 * MIB) // 8,), dtype=torch.int64,
                         generator=torch.Generator().manual_seed(0))
    staging = aligned(len(pool) * 8)  # what each file is written through
    rates: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(args.rounds):
        random.Random(r).shuffle(order)
        files = {}
        for i, name in enumerate(order):  # written before any is read: no read-after-write
            files[name] = args.folder / f"read-{i}.safetensors"
            write_file(files[name], nbytes, unit, pool, staging, r * len(order) + i)
        for name in order:
            drop_cached(files[name])
            rates[name].append(variants[name](files[name], nbytes))
            print(f"round {r} {name:16s} {rates[name][-1] / 1e9:6.2f} GB/s", flush=True)
        for path in files.values():
            path.unlink()

    best = max(statistics.median(rates[n]) for n in rates if n.startswith("shuttle x"))
    rows = [[name, f"{statistics.median(v) / 1e9:.2f}", f"{min(v) / 1e9:.2f}",
             f"{max(v) / 1e9:.2f}", f"{statistics.median(v) / best:.2f}"]
            for name, v in rates.items()]
    table = harness.markdown_table(
        ["variant", "GB/s (median)", "min", "max", "of shuttle's best"], rows)
    print(table)
    if args.smoke:  # the plumbing only: nothing recorded
        return
    notes = (f"{nbytes / 2**30:.2f} GiB per read, {args.rounds} rounds, tier unit "
             f"{unit // MIB} MiB; kvikio: {settings or 'not installed'}")
    harness.write_results(
        "disk_read", {"bytes_per_read": nbytes, "rounds": args.rounds, "unit": unit,
                      "kvikio": settings, "rates": rates},
        table, "Reading weights from disk", notes)


if __name__ == "__main__":
    main()
