"""Multi-process tests: ``run_ranks(fn, world)`` runs ``fn(rank, world, *args)`` in ``world``
processes joined by a process group (a free local port), each under a timeout, and returns what
each rank's ``fn`` returned, its tensors moved to the CPU (or re-raises the first rank's
failure).

The group is gloo on the CPU by default; ``backend="nccl"`` gives each rank its own GPU (rank
``i`` on ``cuda:i``). A rank's function places its tensors on :func:`rank_device` and builds
its meshes on that device's type, so one function serves both; :func:`backends` and
:func:`worlds_and_backends` parametrize a test over gloo and, where the machine has ``world``
GPUs, NCCL."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

TIMEOUT_S = 120


def nccl_marks(world: int) -> list:
    """What a test on ``world`` NCCL ranks is marked with: ``gpu``, and skipped without
    ``world`` GPUs."""
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= world
    return [pytest.mark.gpu,
            pytest.mark.skipif(not enough, reason=f"needs {world} GPUs for NCCL")]


def backends(world: int) -> list:
    """``["gloo", "nccl"]`` as pytest parameters of a ``backend`` argument (NCCL:
    :func:`nccl_marks`)."""
    return ["gloo", pytest.param("nccl", marks=nccl_marks(world))]


def worlds_and_backends(*worlds: int) -> list:
    """Parameters of ``("world", "backend")``: each world size on gloo and on NCCL."""
    return [p for w in worlds
            for p in (pytest.param(w, "gloo"), pytest.param(w, "nccl", marks=nccl_marks(w)))]


def rank_device() -> torch.device:
    """Where this rank's tensors live: its GPU under NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_cpu(value: object) -> object:
    """``value`` with every tensor in it (tuples, lists, dicts) on the CPU, for the parent."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_to_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, out: str, args: tuple, backend: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: object
    try:
        kwargs = {}
        if backend == "nccl":  # rank i on cuda:i, bound at init (barriers know the device)
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
        try:
            result = ("ok", _to_cpu(fn(rank, world, *args)))
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


def run_ranks(fn, world: int, *args: object, backend: str = "gloo") -> list[object]:
    """``[fn(rank, world, *args) for each rank]``, run in ``world`` processes joined by
    ``backend`` (``"gloo"`` or ``"nccl"``).

    Raises:
        AssertionError: a rank raised (its traceback in the message) or the run timed out.
    """
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(fn, world, _free_port(), out, args, backend),
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
