"""Checkpoint load time and peak host memory: shuttle.load_checkpoint with a dense payload adapter
against a plain safetensors load, one interleaved run.

A synthetic bf16 checkpoint of ``--gb`` GB (square ``--side`` x ``--side`` weights, random
values) is loaded into a model built on the ``meta`` device, onto CUDA when present, else the CPU:
    plain            safetensors.torch.load_file(path, device) then
                     load_state_dict(sd, assign=True): the usual fast path, no adapter
    shuttle          shuttle.load_checkpoint(model, path, device=...): no adapter
    shuttle+dense    the same with an adapter carrying ``.diff`` for every 8th weight and a
                     ``.set_weight`` for a parameter the checkpoint lacks (merged in float32 and
                     rounded once, as each tensor arrives)
Time: median of interleaved rounds after one warm-up (the file is in the page cache for every
variant after it). Peak host memory: a fresh subprocess per variant loads once and reports its
peak RSS above its resident memory just before the load (on the CPU that includes the model).

Run on the GPU machine: ``python benchmarks/load.py`` (``--gb 0.2`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import shuttle  # noqa: E402

VARIANTS = ("plain", "shuttle", "shuttle+dense")
_CPU_NOTE = ("; on the CPU the model itself lives in host memory, and load_file only maps the "
             "file: its pages are read when the weights are first used, outside the timing")


def build(n: int, side: int, gate: bool) -> nn.Module:
    """A meta-device model of ``n`` bf16 ``side x side`` linears (+ a gate the checkpoint lacks)."""
    with torch.device("meta"):
        model = nn.Module()
        model.layers = nn.ModuleList(nn.Linear(side, side, bias=False) for _ in range(n))
        if gate:
            model.gate = nn.Linear(side, 64, bias=False)
        return model.to(torch.bfloat16)


def write_checkpoint(path: Path, n: int, side: int) -> int:
    """Random bf16 weights, written one tensor at a time (this process holds one)."""
    nbytes = side * side * 2
    header = {f"layers.{i}.weight": {"dtype": "BF16", "shape": [side, side],
                                     "data_offsets": [i * nbytes, (i + 1) * nbytes]}
              for i in range(n)}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    # Slices of one random pool at scattered offsets: random, never zero, and written at disk
    # speed (a fresh randn per weight would take minutes for a few GB).
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(2 * side * side, generator=g) * 0.02).bfloat16()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for i in range(n):
            start = (i * 1_000_003) % (side * side)
            t = pool[start:start + side * side]
            f.write(memoryview(t.view(torch.int16).numpy()))
    return n * nbytes


def write_adapter(path: Path, n: int, side: int) -> int:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    sd = {f"layers.{i}.diff": (torch.randn(side, side, generator=g) * 1e-3).bfloat16()
          for i in range(0, n, 8)}
    sd["gate.set_weight"] = (torch.randn(64, side, generator=g) * 0.02).bfloat16()
    save_file(sd, str(path))
    return sum(t.numel() * t.element_size() for t in sd.values())


def load(variant: str, ckpt: Path, adapter: Path, n: int, side: int, device: str) -> nn.Module:
    if variant == "plain":
        from safetensors.torch import load_file

        model = build(n, side, gate=False)
        model.load_state_dict(load_file(str(ckpt), device=device), assign=True)
    else:
        model = build(n, side, gate=variant == "shuttle+dense")
        loras = [(str(adapter), 1.0)] if variant == "shuttle+dense" else []
        shuttle.load_checkpoint(model, ckpt, loras, device=device, progress=False)
    return model


def child(args: argparse.Namespace) -> None:
    """One load in a fresh process: print its peak RSS above the RSS just before it."""
    if args.device == "cuda":
        torch.zeros(1, device="cuda")  # the CUDA context is not the load's memory
    before = _status("VmRSS")
    model = load(args.child, Path(args.ckpt), Path(args.adapter), args.n, args.side,
                 args.device)
    # VmHWM, not ru_maxrss: the latter carries the parent's high-water mark through fork + exec.
    peak = _status("VmHWM")
    assert all(not p.is_meta for p in model.parameters())
    print(json.dumps({"before": before, "peak": peak}))


def _status(field: str) -> int:
    """A memory figure of this process from /proc/self/status (Linux), in bytes."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def peak_rss(variant: str, ckpt: Path, adapter: Path, n: int, side: int, device: str) -> int:
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant, "--ckpt", str(ckpt), "--adapter",
         str(adapter), "--n", str(n), "--side", str(side), "--device", device],
        capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["peak"] - r["before"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.0, help="checkpoint size (GB)")
    ap.add_argument("--side", type=int, default=4096, help="weights are side x side (bf16)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write the files (default: a temp dir)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # internal: one measured load in a subprocess
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--adapter", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    side = args.side
    n = max(1, math.ceil(args.gb * 1e9 / (side * side * 2)))
    work = Path(args.dir or tempfile.mkdtemp(prefix="shuttle-load-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        ckpt, adapter = work / "model.safetensors", work / "dense.safetensors"
        size = write_checkpoint(ckpt, n, side)
        adapter_bytes = write_adapter(adapter, n, side)
        dev = args.device

        def run(variant: str):
            def fn(i: int) -> None:
                load(variant, ckpt, adapter, n, side, dev)
            return fn

        timings = harness.interleaved({v: run(v) for v in VARIANTS}, rounds=args.rounds,
                                      warmup=1)
        memory = {v: peak_rss(v, ckpt, adapter, n, side, dev) for v in VARIANTS}
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    base = timings["plain"]["median_ms"]
    rows = [[v, f"{timings[v]['median_ms']:.1f}",
             f"{size / (timings[v]['median_ms'] * 1e-3) / 1e9:.2f}",
             f"{timings[v]['median_ms'] / base:.2f}", f"{memory[v] / 2**20:.0f}"]
            for v in VARIANTS]
    table = harness.markdown_table(
        ["variant", "median ms", "GB/s (checkpoint)", "time vs plain", "peak host MiB"], rows)
    notes = (f"{n} bf16 weights of {side}x{side} ({size / 1e9:.2f} GB) into a meta-device model "
             f"on {dev}; adapter: .diff for every 8th weight and one .set_weight "
             f"({adapter_bytes / 1e6:.0f} MB). {args.rounds} interleaved rounds after 1 warm-up, "
             "median; the file is in the page cache. Peak host memory: a fresh process per "
             "variant, peak RSS above its RSS before the load"
             f"{_CPU_NOTE if dev == 'cpu' else ''}.")
    path = harness.write_results("load", {"config": {**vars(args), "n": n, "bytes": size},
                                          "timings": timings, "peak_host_bytes": memory},
                                 table, "Checkpoint load (benchmarks/load.py)", notes)
    print(table)
    print(notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
