"""Offloading tensor-parallel DTensor weights on 2 ranks: each rank pins and streams its
local shards, the outputs equal the resident sharded model's bit for bit at every residency,
and what the offloader cannot move (FSDP2's own storage, trainable shards) is refused."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests.ranks import nccl_marks, run_ranks

pytest.importorskip("torch.distributed.tensor")

WIDTH, HIDDEN = 8, 12  # 12 hidden units: 6 per rank


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def _tensor_parallel(world: int, device: str = "cpu") -> Net:
    """Net with each block's ``up`` column-parallel and ``down`` row-parallel, its shards on
    ``device`` (the mesh's device type)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = Net().to(device)
    mesh = init_device_mesh(device, (world,))
    for b in model.blocks:
        parallelize_module(b, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model.requires_grad_(False)


def _offload_case(rank, world, device="cpu"):
    from shuttle.offload import CPU_COPY_ENV, ModelOffloader, StreamConfig
    from shuttle.weights.dtensor import is_dtensor

    os.environ[CPU_COPY_ENV] = "1"  # activations on the CPU copy through slots, as on CUDA
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1)).to(device)
    want = _tensor_parallel(world, device)(x).clone()  # clone(): see tests/apply/test_sharded.py
    model = _tensor_parallel(world, device)
    weight = model.blocks[0].up.weight
    off = ModelOffloader.from_module(model, blocks="blocks")
    local = sum(t.numel() * t.element_size()
                for t in (p.to_local() if is_dtensor(p) else p for p in model.parameters()))

    def storage(t):
        return t.to_local().untyped_storage().data_ptr()

    host = {storage(b.up.weight) for b in model.blocks}  # inactive: the shards in host arenas
    arenas = {v.untyped_storage().data_ptr() for u in off.storage.groups["blocks"]
              for v in u.host_views}
    same, moved = [], []
    for cfg in (None, StreamConfig(prefetch=0), StreamConfig(prefetch=1),
                StreamConfig(prefetch=1, resident=1)):
        with off.use(device, cfg) as active:
            for _ in range(2):
                same.append(torch.equal(active(x).clone(), want))
            moved.append(storage(active.blocks[-1].up.weight) not in host)  # in a slot
    kept = model.blocks[0].up.weight is weight and is_dtensor(weight)
    return (same, moved, host <= arenas, off.storage.weight_bytes == local, kept,
            tuple(weight.to_local().shape))


@pytest.mark.parametrize(("device", "backend"), [
    ("cpu", "gloo"), pytest.param("cuda", "gloo", marks=pytest.mark.gpu),
    pytest.param("cuda", "nccl", marks=nccl_marks(2))])
def test_tensor_parallel_shards_stream_and_give_the_resident_outputs(device, backend):
    # on CUDA under gloo two ranks share the GPU (gloo reduces CUDA tensors); under NCCL each
    # rank has its own; each streams its shards
    for same, moved, in_arenas, local_only, kept, shard in run_ranks(_offload_case, 2, device,
                                                                      backend=backend):
        assert all(same)  # whole, streamed without and with prefetch, with a resident block
        assert all(moved) and in_arenas  # the shards really move between host and slots
        assert local_only  # host storage holds this rank's shards, not the global weights
        assert kept and shard == (HIDDEN // 2, WIDTH)  # the same DTensor Parameter, re-pointed


def _refusal_case(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shuttle.errors import OffloadError, StreamModeError
    from shuttle.offload import CPU_COPY_ENV, ModelOffloader, StreamConfig

    os.environ[CPU_COPY_ENV] = "1"
    out = {}
    fsdp = Net()
    for b in fsdp.blocks:
        fully_shard(b, mesh=init_device_mesh("cpu", (world,)))
    try:
        ModelOffloader.from_module(fsdp, blocks="blocks")
    except OffloadError as e:
        out["fsdp"] = "CPUOffloadPolicy" in str(e)
    trained = _tensor_parallel(world).requires_grad_(True)
    try:
        ModelOffloader.from_module(trained, blocks="blocks", trainable="device")
    except OffloadError as e:
        out["device"] = "DTensor" in str(e)
    off = ModelOffloader.from_module(trained, blocks="blocks")
    with off.use("cpu", StreamConfig(prefetch=1)) as active:
        before = active.blocks[0].up.weight.to_local().clone()
        try:
            with off.optimizer_step():
                pass
        except StreamModeError as e:
            out["step"] = "DTensor" in str(e)
        out["unchanged"] = torch.equal(active.blocks[0].up.weight.to_local(), before)
    return out


def test_what_the_offloader_cannot_move_is_refused_with_the_way_out():
    for out in run_ranks(_refusal_case, 2):
        assert out == {"fsdp": True, "device": True, "step": True, "unchanged": True}
