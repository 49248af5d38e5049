"""Merge a LoRA into a sharded model: every rank updates its own shards, no collective.

    torchrun --standalone --nproc-per-node 2 examples/sharded_merge.py         # gloo, CPU
    torchrun --standalone --nproc-per-node 2 examples/sharded_merge.py --cuda  # NCCL, GPUs

Builds a small MLP on every rank, shards its weights by rows (``Shard(0)``, 13 rows on 2
ranks: 7 + 6) and by columns (``Shard(1)``) with ``distribute_tensor``, merges an adapter with
``shuttle.merge_lora``, checks every shard against a single-process merge of the same adapter,
and undoes a scoped merge bit for bit.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import shuttle


def model(device: str) -> nn.Module:
    """A small bf16 MLP, the same on every rank."""
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Linear(8, 13), nn.GELU(), nn.Linear(13, 6)).to(device,
                                                                            torch.bfloat16)


def adapter() -> dict[str, torch.Tensor]:
    """A rank-4 LoRA on both Linears (PEFT keys)."""
    g = torch.Generator().manual_seed(1)
    return {"0.lora_A.weight": torch.randn(4, 8, generator=g) * 0.3,
            "0.lora_B.weight": torch.randn(13, 4, generator=g) * 0.3,
            "2.lora_A.weight": torch.randn(4, 13, generator=g) * 0.3,
            "2.lora_B.weight": torch.randn(6, 4, generator=g) * 0.3}


def check(device: str) -> None:
    """Shard, merge, check against the single-process merge, undo a scoped merge."""
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    rank = dist.get_rank()

    reference = model(device)
    shuttle.merge_lora(reference, [(adapter(), 0.8)])

    sharded = model(device)
    for layer, placement in ((sharded[0], Shard(0)), (sharded[2], Shard(1))):
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh,
                                                      [placement]), requires_grad=False)
    before = [sharded[i].weight.to_local().clone() for i in (0, 2)]
    with shuttle.apply_lora(sharded, [(adapter(), 0.8)], mode="merge"):
        for i in (0, 2):
            assert torch.equal(sharded[i].weight.full_tensor(), reference[i].weight)
    for i, b in zip((0, 2), before, strict=True):
        assert torch.equal(sharded[i].weight.to_local(), b)

    report = shuttle.merge_lora(sharded, [(adapter(), 0.8)])
    for i in (0, 2):
        assert torch.equal(sharded[i].weight.full_tensor(), reference[i].weight)
    if rank == 0:
        print(f"merged {len(report.applied)} weights into row and column shards on "
              f"{dist.get_world_size()} ranks: equal to the single-process merge")


def main() -> None:
    """One rank's run: the process group, the check, the group's teardown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true")
    args = parser.parse_args()
    device = "cuda" if args.cuda else "cpu"
    if args.cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.cuda else "gloo")
    check(device)
    # The sharded tensors and their mesh freed (check's locals, and cycles among them) before
    # the group goes: left to the interpreter's exit, their destructors can run after the
    # group's, and a gloo thread still joinable then aborts the process.
    gc.collect()
    # Every rank done with its collectives before any tears the group down: a rank that leaves
    # first closes connections a peer's gloo threads may still read (they abort the process).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
