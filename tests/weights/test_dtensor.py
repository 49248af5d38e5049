"""DTensor parameters as a weight representation (:mod:`shuttle.weights.dtensor`): what is a
DTensor (an ``isinstance`` check, never a class name, importing nothing), and the
:class:`ShardedWeight` that knows a shard -- found by :func:`represent`, its local tensor and
window, how an update is cut to it, how a load reads and writes it, and what it refuses --
checked on 2 gloo ranks. Whole merges, loads and unmerges on sharded models:
tests/apply/test_sharded.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shuttle.errors import UnsupportedPlacementError
from shuttle.patches import LowRank
from shuttle.weights import ShardedWeight, represent, sharded
from shuttle.weights.dtensor import is_dtensor
from tests.ranks import run_ranks

pytest.importorskip("torch.distributed.tensor")


class DTensor(torch.Tensor):
    """An impostor: named DTensor, and claiming to live where the real one does."""


DTensor.__module__ = "torch.distributed.tensor._api"


def test_a_class_named_dtensor_is_no_dtensor():
    fake = torch.zeros(4, 2).as_subclass(DTensor)
    assert not is_dtensor(fake)
    assert sharded(fake, "w") is None
    assert not ShardedWeight.accepts(fake)


def test_asking_imports_no_torch_distributed_tensor():
    code = ("import sys, torch, shuttle\n"
            "from shuttle.weights import represent, sharded\n"
            "assert sharded(torch.zeros(2)) is None\n"
            "represent(torch.zeros(2, dtype=torch.bfloat16))\n"
            "print('torch.distributed.tensor' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def _dtensor(full: torch.Tensor, placement, mesh):
    """``full`` as a DTensor on 1-D ``mesh``, built from this rank's part (no communication:
    a failed check on one rank is not hidden by another waiting for it).
    """
    from torch.distributed.tensor import DTensor, Partial, Shard

    rank, world = mesh.get_local_rank(), mesh.size()
    if isinstance(placement, Shard):
        local = full.chunk(world, placement.dim)[rank]
    else:
        local = full / world if isinstance(placement, Partial) else full
    return DTensor.from_local(local.clone(), mesh, [placement], run_check=False,
                              shape=full.shape, stride=full.stride())


def _shard_cases(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    w = torch.arange(13 * 6, dtype=torch.float32).reshape(13, 6)  # 13 rows: 7 + 6
    rows = _dtensor(w, Shard(0), mesh)
    param = torch.nn.Parameter(rows, requires_grad=False)
    assert is_dtensor(rows) and is_dtensor(param)

    # found by represent(), of any dtype: a float8 DTensor is sharded, not an Fp8Weight
    s = represent(param)
    assert type(s) is ShardedWeight and s.logical_shape == (13, 6)
    f8 = _dtensor(w.to(torch.float8_e4m3fn), Shard(0), mesh)
    assert type(represent(f8)) is ShardedWeight

    # the local shard and its window (torch.chunk's: 7 + 6 rows)
    lo, hi = [(0, 7), (7, 13)][rank]
    s = sharded(param, "w")
    assert torch.equal(s.local, w[lo:hi]) and s.nbytes == (hi - lo) * 6 * 4
    assert (s.window.starts, s.window.stops) == ((lo, 0), (hi, 6)) and s.sharded_dims == [0]
    assert s.device_type == "cpu" and s.versions() == (param._version, s.local._version)

    # a merge's update, cut to the shard: its rows (local coordinates) and the factor rows
    up, down = torch.randn(13, 2), torch.randn(2, 6)
    patch = LowRank("weight", up=up, down=down)
    cut, local_rows = s.cut(patch, None)
    assert torch.equal(cut.up, up[lo:hi]) and torch.equal(cut.down, down) and local_rows is None
    # rows 5..8 of the weight: rank 0 holds 5, 6 (its local rows 5, 6), rank 1 holds 7, 8 (0, 1)
    cut, local_rows = s.cut(LowRank("weight", up=up[5:9], down=down), (5, 9))
    keep, expect = [((0, 2), (5, 7)), ((2, 4), (0, 2))][rank]
    assert torch.equal(cut.up, up[5:9][slice(*keep)]) and local_rows == expect
    tail = s.cut(LowRank("weight", up=up[9:], down=down), (9, 13))  # rows that rank 1 alone holds
    assert (tail is None) if rank == 0 else (tail[1] == (2, 6))
    cols = sharded(_dtensor(w, Shard(1), mesh), "v")  # columns 0..2, 3..5
    cut, local_rows = cols.cut(patch, None)
    c0, c1 = [(0, 3), (3, 6)][rank]
    assert torch.equal(cut.up, up) and torch.equal(cut.down, down[:, c0:c1]) and local_rows is None

    # a load: the rows to read, and the window written from them into the local tensor
    assert s.read_rows() == (lo, hi) and cols.read_rows() is None
    s.local.zero_()
    s.write(w[lo:], row0=lo)
    assert torch.equal(rows.to_local(), w[lo:hi])
    cols.local.zero_()
    cols.write(w)
    assert torch.equal(cols.local, w[:, c0:c1])

    # refusals: a placement without a window, a widening, a shard past the columns, the
    # global weight as a whole, and a meta DTensor for a load
    refused = []
    partial = sharded(_dtensor(w, Partial(), mesh), "p")
    cube = sharded(_dtensor(torch.zeros(2, 3, 4), Shard(2), mesh), "c")
    meta = sharded(_dtensor(torch.empty(4, 2, device="meta"), Shard(0), mesh), "m")
    for call in (partial.check_merge, lambda _: s.check_merge("nearest", widened=True),
                 cube.check_merge, lambda _: s.dequantize(), lambda _: s.encode(w),
                 lambda _: meta.check_load(), lambda _: partial.check_load()):
        with pytest.raises(UnsupportedPlacementError) as info:
            call(None)
        refused.append(str(info.value))
    s.check_merge(None)  # rows of a plain weight: taken
    sharded(_dtensor(w, Replicate(), mesh), "r").check_load()
    return refused


def test_a_sharded_weight_knows_its_shard_on_two_ranks():
    for refused in run_ranks(_shard_cases, 2):
        for text, word in zip(refused, ("Partial", "widens", "dimension(s) [2]", "'w'", "'w'",
                                        "meta device", "Partial"), strict=True):
            assert word in text, (word, text)
