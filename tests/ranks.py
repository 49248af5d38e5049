"""Multi-process tests on the CPU: ``run_ranks(fn, world)`` runs ``fn(rank, world, *args)`` in
``world`` processes joined by a gloo process group (a free local port), each under a timeout,
and returns what each rank's ``fn`` returned (or re-raises the first rank's failure)."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, out: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: object
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            result = ("ok", fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - carried to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    # Leave without the interpreter's teardown: destroying gloo's objects at exit can abort
    # the process ("terminate called without an active exception") after its work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args: object) -> list[object]:
    """``[fn(rank, world, *args) for each rank]``, run in ``world`` gloo processes.

    Raises:
        AssertionError: a rank raised (its traceback in the message) or the run timed out.
    """
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(fn, world, _free_port(), out, args),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(f"ranks did not finish within {TIMEOUT_S} s")
        results = []
        for rank in range(world):
            path = Path(out, f"{rank}.pkl")
            assert path.exists(), f"rank {rank} left no result"
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                raise AssertionError(f"rank {rank} failed: {value}")
            results.append(value)
        return results
