"""Two-GPU claims, each against the same work on one GPU, in one interleaved run:

    tensor parallel   a Llama-8B MLP pair (4096 -> 14336 column-parallel, 14336 -> 4096
                      row-parallel, bf16, 8192 tokens) forward, without and with a rank-16
                      dynamic LoRA (shuttle.attach_lora on the parallelized layers), against
                      the whole MLP on one GPU without and with the same adapter
    sharded load      shuttle.load_checkpoint of a bf16 checkpoint (square weights) into an
                      FSDP2-sharded model (each rank writes its shards in place, reading only
                      their rows where no adapter changes a tensor), without and with a dense
                      payload adapter (a ``.diff`` on every 8th weight, a ``.set_weight``),
                      against the whole model on one GPU

Run: ``torchrun --standalone --nproc-per-node 2 benchmarks/distributed.py`` (NCCL, one GPU a
rank). A one-GPU variant runs on rank 0 while the other ranks wait at a barrier; a sharded
variant's time is the slowest rank's. Rounds are interleaved in the same seeded order on every
rank, medians reported; the checkpoint is in the page cache after the warm-up round. Smoke run
on the CPU: ``--device cpu --small`` (gloo).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import load as load_bench  # noqa: E402
import shuttle  # noqa: E402

Variant = tuple[Callable[[int], object], bool]  # (call of round i, whether every rank runs it)


def interleaved(variants: dict[str, Variant], rounds: int, warmup: int,
                device: torch.device) -> dict[str, dict[str, float]]:
    """:func:`harness.interleaved` over the ranks: one-GPU variants run on rank 0 alone (the
    others wait at the barrier), sharded ones on every rank, timed as the slowest rank."""
    rank = dist.get_rank()

    def timer(name: str, fn: Callable[[int], object], i: int) -> float:
        everyone = variants[name][1]
        dist.barrier()
        ms = harness.time_once(fn, i) if everyone or rank == 0 else 0.0
        if everyone:
            t = torch.tensor([ms], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ms = t.item()
        dist.barrier()
        return ms

    # harness.interleaved orders each round by a seed of its own: the same order on every rank
    return harness.interleaved({k: fn for k, (fn, _) in variants.items()}, rounds=rounds,
                               warmup=warmup, timer=timer)


# -- tensor-parallel LoRA MLP ----------------------------------------------------------------

def _mlp(hidden: int, inner: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and for every copy
    return nn.Sequential(nn.Linear(hidden, inner, bias=False), nn.GELU(),
                         nn.Linear(inner, hidden, bias=False)).to(device, torch.bfloat16)


def _adapter(hidden: int, inner: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shapes = {"0": (inner, hidden), "2": (hidden, inner)}
    sd = {}
    for m, (out_f, in_f) in shapes.items():
        sd[f"{m}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.02
        sd[f"{m}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.02
    return sd


def bench_tensor_parallel(args: argparse.Namespace, device: torch.device) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    hidden, inner, tokens, rank = ((256, 512, 64, 8) if args.small
                                   else (4096, 14336, 8192, 16))
    sd = _adapter(hidden, inner, rank)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    tp = parallelize_module(_mlp(hidden, inner, device), mesh, plan)
    tp_lora = parallelize_module(_mlp(hidden, inner, device), mesh, plan)
    shuttle.attach_lora(tp_lora, [(sd, 1.0)])
    one = one_lora = None
    if dist.get_rank() == 0:
        one = _mlp(hidden, inner, device)
        one_lora = copy.deepcopy(one)
        shuttle.attach_lora(one_lora, [(sd, 1.0)])
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16) for _ in range(3)]

    def run(model_of: Callable[[], nn.Module]) -> Callable[[int], object]:
        @torch.no_grad()
        def fn(i: int) -> object:
            out = model_of()(xs[i % len(xs)])
            # a row-parallel output is an AsyncCollectiveTensor: wait, so the all-reduce is in
            # the timed work
            return out.wait() if hasattr(out, "wait") else out
        return fn

    with torch.no_grad():  # the sharded result against the one-GPU one, same adapter
        got = tp_lora(xs[0]).clone()  # clone(): lands the row-parallel all-reduce
        err = float("nan")
        if one_lora is not None:
            want = one_lora(xs[0]).float()
            err = ((got.float() - want).norm() / want.norm()).item()
    variants: dict[str, Variant] = {
        "one GPU": (run(lambda: one), False), "one GPU + LoRA": (run(lambda: one_lora), False),
        "tensor parallel": (run(lambda: tp), True),
        "tensor parallel + LoRA": (run(lambda: tp_lora), True)}
    times = interleaved(variants, args.rounds, 3, device)
    return {"shape": {"hidden": hidden, "inner": inner, "tokens": tokens, "rank": rank},
            "times": times, "rel_err_vs_one_gpu": err}


# -- sharded load with dense payloads --------------------------------------------------------

def _materialized(n: int, side: int, gate: bool, device: torch.device, shard: bool
                  ) -> nn.Module:
    """load.py's model on ``device``, FSDP2-sharded over every rank when ``shard``."""
    model = load_bench.build(n, side, gate)
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model.to_empty(device=device)


def bench_sharded_load(args: argparse.Namespace, device: torch.device, work: Path) -> dict:
    from shuttle.formats.safetensors_file import SafetensorsFile

    side = 256 if args.small else args.side
    n = max(8, math.ceil((0.01 if args.small else args.gb) * 1e9 / (side * side * 2)))
    ckpt, adapter = work / "model.safetensors", work / "dense.safetensors"
    if dist.get_rank() == 0:
        load_bench.write_checkpoint(ckpt, n, side)
        load_bench.write_adapter(adapter, n, side)
    dist.barrier()
    size = ckpt.stat().st_size
    models = {(dense, shard): _materialized(n, side, dense, device, shard)
              for dense in (False, True) for shard in (False, True)
              if shard or dist.get_rank() == 0}

    def run(dense: bool, shard: bool) -> Callable[[int], object]:
        def fn(i: int) -> object:
            loras = [(str(adapter), 1.0)] if dense else []
            return shuttle.load_checkpoint(models[dense, shard], ckpt, loras, progress=False)
        return fn

    read: list[int] = []  # bytes this rank reads from the file, in one untimed load each
    original = SafetensorsFile._read_copy

    def counting(self, begin, end, raw=None):
        read.append(end - begin)
        return original(self, begin, end, raw)

    bytes_read = {}
    SafetensorsFile._read_copy = counting
    try:
        for dense in (False, True):
            for shard in (False, True):
                if shard or dist.get_rank() == 0:
                    read.clear()
                    run(dense, shard)(0)
                    bytes_read[f"{'sharded' if shard else 'one GPU'}{' + dense' if dense else ''}"
                               ] = sum(read)
    finally:
        SafetensorsFile._read_copy = original
    variants: dict[str, Variant] = {
        "one GPU": (run(False, False), False), "one GPU + dense": (run(True, False), False),
        "FSDP2": (run(False, True), True), "FSDP2 + dense": (run(True, True), True)}
    times = interleaved(variants, args.rounds, 1, device)
    return {"n": n, "side": side, "bytes": size, "times": times,
            "rank0_bytes_read": bytes_read}


# -- report ----------------------------------------------------------------------------------

def write(tp: dict, ld: dict, world: int) -> None:
    t = {k: v["median_ms"] for k, v in tp["times"].items()}
    s = tp["shape"]
    rows = [[f"MLP {s['hidden']} -> {s['inner']} -> {s['hidden']}, {s['tokens']} tokens",
             f"{t['one GPU']:.3f}", f"{t['tensor parallel']:.3f}",
             f"**{t['one GPU'] / t['tensor parallel']:.2f}x**",
             f"{t['one GPU + LoRA'] / t['one GPU']:.3f}x",
             f"**{t['tensor parallel + LoRA'] / t['tensor parallel']:.3f}x**",
             f"{tp['rel_err_vs_one_gpu']:.1e}"]]
    table = harness.markdown_table(
        ["tensor parallel (forward)", "one GPU ms", f"{world} GPUs ms", "speedup",
         f"rank-{s['rank']} LoRA, one GPU", f"LoRA, {world} GPUs", "rel. err vs one GPU"], rows)
    lt = {k: v["median_ms"] for k, v in ld["times"].items()}
    gb = ld["bytes"] / 1e9
    rows = [[name, f"{lt[name]:.1f}", f"{gb / (lt[name] * 1e-3):.2f}",
             f"{ld['rank0_bytes_read'][key] / 1e9:.2f}"]
            for name, key in (("one GPU", "one GPU"), ("one GPU + dense", "one GPU + dense"),
                              ("FSDP2", "sharded"), ("FSDP2 + dense", "sharded + dense"))]
    table += "\n\n" + harness.markdown_table(
        ["sharded load", "ms", "GB/s (checkpoint)", "GB read by rank 0"], rows)
    notes = (f"{world} ranks (one GPU each; NCCL on CUDA). Tensor parallel: column-parallel "
             "first linear, row-parallel second (its all-reduce included), bf16, no_grad "
             "forward; the LoRA is attached with shuttle.attach_lora after parallelize_module. "
             f"Sharded load: {ld['n']} bf16 weights of {ld['side']}x{ld['side']} "
             f"({gb:.2f} GB) into materialized models, in place; the dense adapter carries a "
             ".diff for every 8th weight and a .set_weight (benchmarks/load.py's). A sharded "
             "variant's time is its slowest rank's; medians of interleaved rounds.")
    harness.write_results("distributed", {"world": world, "tensor_parallel": tp,
                                          "sharded_load": ld},
                          table, "Two GPUs (benchmarks/distributed.py)", notes)
    print(table)
    print(notes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--gb", type=float, default=4.0, help="checkpoint size of the load (GB)")
    ap.add_argument("--side", type=int, default=8192, help="load: weights are side x side")
    ap.add_argument("--small", action="store_true", help="small shapes (a smoke run)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    work = Path(tempfile.mkdtemp(prefix="shuttle-dist-")) if dist.get_rank() == 0 else None
    box = [str(work)]
    dist.broadcast_object_list(box, src=0)
    work = Path(box[0])
    try:
        tp = bench_tensor_parallel(args, device)
        ld = bench_sharded_load(args, device, work)
        if dist.get_rank() == 0:
            write(tp, ld, dist.get_world_size())
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(work, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
