"""The fused tiers' second kernel launched as the shrink's programmatic dependent, against the same
kernels in stream order, at the shapes of benchmarks/dynamic_lora.py where the tiers do so, one
interleaved run.

A two-kernel form computes S = (x @ A.T) * scale first, then the GEMM over [x | S] and [W | B].
In stream order the GEMM starts once the shrink has ended (its launch, its prologue and the
shrink's last programs are time the GPU is partly idle). Launched as the shrink's programmatic
dependent (sm_90: ``launch_pdl`` / ``use_pdl``) it starts while the shrink runs, streaming x and W
(which were in memory before the shrink began) and waits for the shrink's end only before its
first S tile. Per shape (tokens T, in K, out N, rank r), bf16 with bias:
    base        F.linear (cuBLAS)
    fused       at T <= 64 (decode): PreparedLoraDecode.linear, the split-K shrink then the
                output kernel streaming W; above, PreparedLoraLinear "fused": Triton's short
                shrink (at most 8192 rows of 4096 features: the shapes run here) and GEMM
each ``ordered`` (pdl=False) and ``dependent`` (pdl=True, the default), their outputs compared bit
for bit. (The CuTe GEMM as a dependent, CuteLoraGemm(pdl=True), is not a tier's: measured at
126def4, this file's history.) Timed in CUDA graphs (one call a replay, inputs rotated; and
BURST calls in one graph: the clocks a chain of layers sustains) and eagerly in bursts of BURST
calls, CUDA events, medians of interleaved rounds after warm-up.
Usage: python benchmarks/dependent_launch.py [rounds] [--shapes a,b]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from dynamic_lora import BURST, SHAPES, burst_of  # noqa: E402
from shuttle.kernels.lora_decode import DECODE_MAX_T, PreparedLoraDecode  # noqa: E402
from shuttle.kernels.lora_linear_tma import PreparedLoraLinear  # noqa: E402
from shuttle.kernels.lora_shrink import short_shrink  # noqa: E402

ORDERS = ("ordered", "dependent")


def layer_calls(t: int, k: int, n: int, r: int) -> tuple[dict, list[torch.Tensor]]:
    """name -> fn(x) for the base and each form in both orders; the rotating inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    bias = (torch.randn(n, device="cuda", generator=g) * 0.1).bfloat16()
    down = (torch.randn(r, k, device="cuda", generator=g) / k**0.5).bfloat16()
    up = (torch.randn(n, r, device="cuda", generator=g) * 0.02).bfloat16()
    scale = torch.full((r,), 0.4, device="cuda")
    xs = [torch.randn(t, k, device="cuda", generator=g).bfloat16() for _ in range(2)]
    calls = {"base": lambda x: F.linear(x, w, bias)}
    for order in ORDERS:
        pdl = order == "dependent"
        if t <= DECODE_MAX_T:
            prep = PreparedLoraDecode(down, up, pdl=pdl)
            calls[f"fused {order}"] = lambda x, p=prep: p.linear(x, w, bias, scale)
            continue
        prep = PreparedLoraLinear(w, bias, down, up, "fused", pdl=pdl)
        calls[f"fused {order}"] = lambda x, p=prep: p(x, scale)
    return calls, xs


def bench_shape(t: int, k: int, n: int, r: int, rounds: int) -> dict:
    calls, xs = layer_calls(t, k, n, r)
    with torch.no_grad():
        outs = {q: fn(xs[0]) for q, fn in calls.items()}
        forms = sorted({q.split()[0] for q in calls if q != "base"})
        identical = {f: bool(torch.equal(outs[f"{f} ordered"], outs[f"{f} dependent"]))
                     for f in forms}
        eager = harness.interleaved(
            {q: (lambda i, fn=fn: [fn(xs[(i + j) % 2]) for j in range(BURST)])
             for q, fn in calls.items()}, rounds=rounds, warmup=3)
    graphs = {q: [harness.graphed(lambda fn=fn, x=x: fn(x)) for x in xs]
              for q, fn in calls.items()}
    with torch.no_grad():
        single = harness.interleaved({q: (lambda i, g=g: g[i % 2].replay())
                                      for q, g in graphs.items()}, rounds=rounds, warmup=3)
    del graphs

    graphs = {q: harness.graphed(burst_of(fn, xs)) for q, fn in calls.items()}
    with torch.no_grad():
        burst = harness.interleaved({q: (lambda i, g=g: g.replay()) for q, g in graphs.items()},
                                    rounds=rounds, warmup=3)
    del graphs
    columns = {"graph": (single, 1), "graph burst": (burst, BURST), "eager burst": (eager, BURST)}
    ms = {col: {q: v["median_ms"] / per for q, v in got.items()}
          for col, (got, per) in columns.items()}
    overhead = {col: {q: 100 * (v - got["base"]) / got["base"] for q, v in got.items()
                      if q != "base"} for col, got in ms.items()}
    return {"shape": (t, k, n, r), "ms": ms, "overhead_pct": overhead,
            "bit_identical": identical}


def write(rows: dict) -> None:
    headers = ["shape", "(T, K, N, r)", "graph base ms", "form",
               "graph: ordered / dependent", "graph burst: ordered / dependent",
               "eager burst: ordered / dependent", "dependent, us saved a call (graph)",
               "bit-identical"]
    table = []
    for name, row in rows.items():
        forms = sorted(row["bit_identical"])
        for f in forms:
            cells = []
            for col in ("graph", "graph burst", "eager burst"):
                o = row["overhead_pct"][col]
                cells.append(f"+{o[f'{f} ordered']:.1f}% / **+{o[f'{f} dependent']:.1f}%**")
            saved = 1e3 * (row["ms"]["graph"][f"{f} ordered"]
                           - row["ms"]["graph"][f"{f} dependent"])
            table.append([name, tuple(row["shape"]), f"{row['ms']['graph']['base']:.4f}", f,
                          *cells, f"{saved:.1f}", row["bit_identical"][f]])
    notes = ("Overheads over the base F.linear (cuBLAS, with bias), medians of interleaved "
             "rounds. ordered: the second kernel launched after the shrink in stream order; "
             "dependent: launched as the shrink's programmatic dependent (the default on sm_90). "
             "graph: one call per CUDA-graph replay, inputs rotated; graph burst: "
             f"{BURST} calls in one graph, per call; eager burst: {BURST} eager calls between "
             "two events, per call.")
    path = harness.write_results(
        "dependent_launch", {"rows": rows},
        harness.markdown_table(headers, table),
        "The second kernel as the shrink's programmatic dependent "
        "(benchmarks/dependent_launch.py)", notes)
    print(path.read_text(), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rounds", type=int, nargs="?", default=30)
    p.add_argument("--shapes", default="", help=f"comma-separated among {', '.join(SHAPES)}")
    args = p.parse_args()
    names = [s for s in args.shapes.split(",") if s] or [
        name for name, (t, k, _, _) in SHAPES.items() if t <= DECODE_MAX_T or short_shrink(t, k)]
    harness.spin_up()
    rows = {}
    for name in names:
        rows[name] = bench_shape(*SHAPES[name], rounds=args.rounds)
        write(rows)


if __name__ == "__main__":
    main()
