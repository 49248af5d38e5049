"""Tile shapes for the fused merge kernel (shuttle.kernels.merge_lowrank) on this GPU.

One bf16 weight of 12288x3072 (rotating among 8 so the L2 never holds it), rank 64; GB/s of the
weight read + written; the copy of the same bytes is the ceiling. Writes
docs/benchmarks/merge_kernel_tuning_wide.{json,md} (merge_kernel_tuning.md: an earlier
sweep against a TMA variant of the kernel, since dropped).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from shuttle.kernels.merge_lowrank import merge_lowrank  # noqa: E402


def main() -> None:
    m, n, r, k = 12288, 3072, 64, 8
    ws = [torch.randn(m, n, device="cuda").bfloat16() for _ in range(k)]
    up = (torch.randn(m, r, device="cuda") * 0.02).bfloat16()
    down = (torch.randn(r, n, device="cuda") * 0.02).bfloat16()
    src, dst = ws[0].clone(), ws[1].clone()
    # A small sweep: each config costs a compile (seconds) on the GPU machine.
    configs = [c for c in itertools.product((32, 64, 128), (64, 128, 256), (2, 4, 8))
               if c[0] * c[1] // (32 * c[2]) <= 256]  # at most 256 accumulator floats/thread
    variants = {"copy": lambda i: dst.copy_(src)}
    for c in configs:
        variants[str(c)] = lambda i, c=c: merge_lowrank(ws[i % k], up, down, [0, r], [0.5], c)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    best = (64, 128, 8)
    variants[f"{best} overflow flag"] = lambda i: merge_lowrank(
        ws[i % k], up, down, [0, r], [0.5], best, overflow=flag)
    t = harness.interleaved(variants, rounds=12, warmup=2)
    # the kernel's own time (profiler), apart from the launch's host time in each timed call
    gpu = {k_: harness.gpu_ms(f, n=8) for k_, f in variants.items()}
    nbytes = 2 * m * n * 2
    rows = sorted(([k_, f"{v['median_ms'] * 1e3:.1f}", f"{nbytes / v['median_ms'] / 1e6:.0f}",
                    f"{gpu[k_] * 1e3:.1f}", f"{nbytes / gpu[k_] / 1e6:.0f}"]
                   for k_, v in t.items()), key=lambda row: float(row[3]))
    headers = ["(BM, BN, warps)", "median us (per call)", "GB/s (per call)", "kernel us",
               "GB/s (kernel)"]
    table = harness.markdown_table(headers, rows)
    harness.write_results("merge_kernel_tuning_wide", {"timings": t, "kernel_ms": gpu}, table,
                          "Fused merge kernel tile shapes, wide sweep "
                          "(benchmarks/tune_merge_kernel.py)")
    print(table)
    best = next(row[0] for row in rows if row[0] != "copy")
    (harness.OUT_DIR / "merge_kernel_best.txt").write_text(best)  # e.g. "(64, 128, 8)"


if __name__ == "__main__":
    main()
