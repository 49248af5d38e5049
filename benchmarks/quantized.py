"""Merging into quantized weights: the fused Triton kernels against dequantize / requantize.

Per format, one weight of ``--rows`` x ``--cols`` (default 12288 x 3072) encoded from random
bf16 values, and two rank-64 adapters alternating between rounds:

    triton      rep.merge_lowrank(...): the format's fused kernel (the merged weight is never
                materialized in float32)
    reference   rep.encode(rep.dequantize() + update): what merge_lora does without a kernel

Formats: float8 e4m3 with a per-row scale, int8 with a per-row absmax (LLM.int8()), NF4 with
a per-64 block absmax (bitsandbytes, not nested). All math is shuttle's own; no quantization
library is needed. Also reported: the error of the merged weight against float64 math, for
nearest and stochastic rounding (RMS over elements, and the mean error: stochastic rounding is
unbiased, so its mean error tends to zero while its RMS is larger).

Target (issue 6): the kernels at least 10x the reference path.

    python benchmarks/quantized.py                       # on the GPU machine
    python benchmarks/quantized.py --rows 256 --cols 256 --rounds 2   # smoke (CPU interpreter)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from shuttle.weights import Fp8Weight  # noqa: E402
from shuttle.weights.bnb import Bnb4bitWeight, BnbInt8Weight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels run in Triton's interpreter
# bitsandbytes' NF4 code (normal-distribution quantiles, QLoRA), as float32.
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def encoded(fmt: str, w: torch.Tensor):
    """``w`` (float32) in the format's representation, through its own ``encode``."""
    m, n = w.shape
    if fmt == "fp8_rowwise":
        empty = Fp8Weight(torch.zeros(m, n, dtype=torch.float8_e4m3fn, device=w.device),
                          torch.ones(m, device=w.device))
    elif fmt == "int8_rowwise":
        empty = BnbInt8Weight(torch.zeros(m, n, dtype=torch.int8, device=w.device),
                              torch.ones(m, device=w.device), torch.bfloat16)
    else:
        blocks = m * n // 64
        empty = Bnb4bitWeight(torch.zeros(m * n // 2, 1, dtype=torch.uint8, device=w.device),
                              torch.ones(blocks, device=w.device),
                              torch.tensor(NF4, device=w.device), None, None, None, (m, n), 64,
                              None, "nf4", torch.bfloat16)
    return empty.encode(w)


def errors(rep, exact: torch.Tensor) -> dict[str, float]:
    err = rep.dequantize().double() - exact
    return {"rms": float(err.pow(2).mean().sqrt()), "mean": float(err.mean())}


def bench_format(rep, adapters, alpha: list[float], rounds: int) -> dict | None:
    """Time the fused kernel against the reference path; errors for both roundings."""
    r = adapters[0][0].shape[1]

    def update(i: int) -> torch.Tensor:
        up, down = adapters[i % 2]
        return alpha[0] * (up.float() @ down.float())

    def reference(i: int, rounding: str = "nearest"):
        gen = torch.Generator(device=DEVICE).manual_seed(i)
        return rep.encode(rep.dequantize() + update(i), rounding, gen)

    def triton(i: int, rounding: str = "nearest"):
        up, down = adapters[i % 2]
        return rep.merge_lowrank(up, down, [0, r], alpha, rounding=rounding, seed=i)

    if triton(0) is None:
        return None
    timings = harness.interleaved({"triton": triton, "reference": reference}, rounds=rounds,
                                  warmup=2)
    exact = rep.dequantize().double() + update(0).double()
    err = {f"{v}_{q}": errors(fn(0, q), exact) for v, fn in
           (("triton", triton), ("reference", reference)) for q in ("nearest", "stochastic")}
    return {"timings": timings, "errors": err,
            "speedup": timings["reference"]["median_ms"] / timings["triton"]["median_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=12288)
    ap.add_argument("--cols", type=int, default=3072)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    m, n, r = args.rows, args.cols, args.rank
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w = torch.randn(m, n, device=DEVICE, generator=g).bfloat16().float()
    adapters = [((torch.randn(m, r, device=DEVICE, generator=g) * 0.02).bfloat16(),
                 (torch.randn(r, n, device=DEVICE, generator=g) / n**0.5).bfloat16())
                for _ in range(2)]
    alpha = [0.5]
    results, rows = {}, []
    for fmt in ("fp8_rowwise", "int8_rowwise", "nf4"):
        res = bench_format(encoded(fmt, w), adapters, alpha, args.rounds)
        if res is None:
            print(f"{fmt}: no fused kernel applies; skipped", flush=True)
            continue
        results[fmt] = res
        t, err = res["timings"], res["errors"]
        rows.append([fmt, f"{t['triton']['median_ms']:.3f}", f"{t['reference']['median_ms']:.3f}",
                     f"{res['speedup']:.1f}x", f"{err['triton_nearest']['rms']:.2e}",
                     f"{err['triton_stochastic']['rms']:.2e}",
                     f"{err['triton_stochastic']['mean']:+.1e}",
                     f"{err['reference_nearest']['rms']:.2e}"])
        print(rows[-1], flush=True)
    table = harness.markdown_table(
        ["format", "triton ms", "reference ms", "speedup", "rms err nearest",
         "rms err stochastic", "mean err stochastic", "reference rms err nearest"], rows)
    notes = (f"One {m}x{n} weight, rank-{r} adapters (alpha {alpha[0]}) alternating; medians of "
             f"{args.rounds} interleaved rounds. Errors: the merged weight dequantized, against "
             "the float64 sum of the dequantized weight and the update. Target: >= 10x.")
    harness.write_results("quantized", {"shape": [m, n], "rank": r, "formats": results}, table,
                          "Merging into quantized weights (benchmarks/quantized.py)", notes)
    print(table)
    print(notes)


if __name__ == "__main__":
    main()
