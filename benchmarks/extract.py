"""Adapter extraction throughput: shuttle.extract_lora against the usual full-SVD script.

A synthetic pair of bf16 checkpoints (``--layers`` weights of ``--side`` x ``--side``; the tuned
one is the base plus a rank-``--true-rank`` update plus small noise) is turned into a rank
``--rank`` adapter:
    shuttle    shuttle.extract_lora(base, tuned, out, rank=R, device=...): tensor by tensor,
               randomized SVD on the device, written as ComfyUI-readable safetensors
    full_svd   what extraction scripts commonly do: per weight, torch.linalg.svd of the float32
               difference on the device, truncated to R, factors written with save_file
Reported: seconds, GB/s of checkpoint read (base + tuned), and the captured energy.

Run on the GPU machine: ``python benchmarks/extract.py`` (``--layers 2 --side 512`` to smoke).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import shuttle  # noqa: E402


def make_pair(root: Path, layers: int, side: int, true_rank: int) -> tuple[Path, Path]:
    g = torch.Generator().manual_seed(0)
    base, tuned = {}, {}
    for i in range(layers):
        w = torch.randn(side, side, generator=g) * 0.02
        u = torch.randn(side, true_rank, generator=g) * 0.01
        v = torch.randn(true_rank, side, generator=g) * 0.01
        base[f"blocks.{i}.proj.weight"] = w.bfloat16()
        tuned[f"blocks.{i}.proj.weight"] = (w + u @ v + torch.randn(side, side, generator=g)
                                           * 1e-4).bfloat16()
    save_file(base, str(root / "base.safetensors"))
    save_file(tuned, str(root / "tuned.safetensors"))
    return root / "base.safetensors", root / "tuned.safetensors"


def full_svd(base: Path, tuned: Path, out: Path, rank: int, device: str) -> float:
    b, t = load_file(str(base)), load_file(str(tuned))
    factors, captured, total = {}, 0.0, 0.0
    for name, w in b.items():
        d = (t[name].to(device).float() - w.to(device).float())
        u, s, vh = torch.linalg.svd(d, full_matrices=False)
        captured += float((s[:rank] ** 2).sum())
        total += float((s ** 2).sum())
        module = name.removesuffix(".weight")
        factors[f"{module}.lora_up.weight"] = (u[:, :rank] * s[:rank]).bfloat16().contiguous().cpu()
        factors[f"{module}.lora_down.weight"] = vh[:rank].bfloat16().contiguous().cpu()
    save_file(factors, str(out))
    return captured / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--side", type=int, default=3072)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--true-rank", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, tuned = make_pair(root, args.layers, args.side, args.true_rank)
        nbytes = base.stat().st_size + tuned.stat().st_size
        energy: dict[str, float] = {}

        def run_shuttle(i: int) -> None:
            report = shuttle.extract_lora(base, tuned, root / "a.safetensors", rank=args.rank,
                                          device=device, progress=False)
            energy["shuttle"] = report.energy

        def run_full(i: int) -> None:
            energy["full_svd"] = full_svd(base, tuned, root / "b.safetensors", args.rank, device)

        timings = harness.interleaved({"shuttle": run_shuttle, "full_svd": run_full},
                                      rounds=args.rounds, warmup=1)
    rows = [[k, f"{v['median_ms'] / 1e3:.2f}", f"{nbytes / (v['median_ms'] * 1e6):.2f}",
             f"{timings['full_svd']['median_ms'] / v['median_ms']:.2f}", f"{energy[k]:.4f}"]
            for k, v in timings.items()]
    table = harness.markdown_table(
        ["variant", "seconds", "GB/s (base + tuned read)", "speedup vs full SVD",
         "captured energy"], rows)
    notes = (f"{args.layers} bf16 weights of {args.side}x{args.side} per checkpoint "
             f"({nbytes / 2e9:.2f} GB each), true update rank {args.true_rank} plus noise, "
             f"extracted at rank {args.rank} on {device}; {args.rounds} interleaved rounds "
             "after one warm-up, median.")
    harness.write_results("extract", {"config": vars(args), "timings": timings,
                                      "energy": energy}, table,
                          "Adapter extraction throughput (benchmarks/extract.py)", notes)
    print(table)
    print(notes)


if __name__ == "__main__":
    main()
