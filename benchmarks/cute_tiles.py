"""The CuTe LoRA GEMM's tiles against each other, cuBLAS and the base GEMM, one interleaved run.

Per shape (tokens T, in K, out N, rank r; bf16 with bias), each tile of
``shuttle.kernels.cute_dsl`` (the cooperative 128 x 256 and 128 x 192, the ping-pong 128 x 192)
in both forms:

    <tile> sg   S given (Triton's shrink computed once beforehand): the K-extended GEMM alone
    <tile> sh   S tiles among the kernel's own work units (x read from memory once)

beside the base GEMM (``F.linear``), cuBLAS's K-extended GEMM over ``[x | S]`` and ``[W | B]``
(the same work the S-given form does), and the prepared layer of each fused form
(``PreparedLoraLinear``: Triton's shrink, then the GEMM), all captured in CUDA graphs of BURST
calls and replayed, interleaved. Every output is checked against float64, and the ping-pong
tile's against the cooperative 128 x 192 tile's bit for bit (their accumulation orders agree).

Writes docs/benchmarks/cute_tiles.{json,md} after every shape (a cut-off run keeps its rows).
Needs the ``hopper`` extra on an sm_90 GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from fused_breakdown import operands  # noqa: E402
from shuttle.kernels.cute_dsl import CUTE_TILES, PINGPONG_TILES  # noqa: E402
from shuttle.kernels.lora_linear_cute import CuteLoraGemm, cute_available  # noqa: E402
from shuttle.kernels.lora_linear_tma import PreparedLoraLinear  # noqa: E402
from shuttle.kernels.lora_shrink import lora_shrink  # noqa: E402

SHAPES = {"wan1.3b_attn": (32760, 1536, 1536, 128), "wan1.3b_ffn_up": (32760, 1536, 8960, 128),
          "wan1.3b_ffn_down": (32760, 8960, 1536, 128), "zimage_attn": (4352, 3840, 3840, 32),
          "dit_qkv": (4096, 1536, 4608, 64), "dit_out": (4096, 1536, 1536, 64),
          "dit_up": (4096, 1536, 6144, 64), "dit_down": (4096, 6144, 1536, 64)}
TILES = {"c256": CUTE_TILES[0], "c192": CUTE_TILES[1], "p192": PINGPONG_TILES[0]}
BURST = 10  # calls per graph: the clocks a chain of layers sustains


def _burst(fn):
    """BURST calls of ``fn``: the unit each graph captures."""
    def run():
        for _ in range(BURST):
            fn()
    return run


def bench_shape(t: int, k: int, n: int, r: int, rounds: int) -> dict:
    x, w, bias, down, up, scale = operands(t, k, n, r)
    s = lora_shrink(x, down, scale)
    xs, wu = torch.cat([x, s], 1), torch.cat([w, up], 1)
    ref = x.double() @ w.double().T + bias.double() + s.double() @ up.double().T
    fns = {"base": lambda: F.linear(x, w, bias), "cublas_kext": lambda: F.linear(xs, wu, bias)}
    outs, err = {}, {}
    for name, tile in TILES.items():
        for form in ("sg", "sh"):
            gemm = CuteLoraGemm(w, up, True, tile, down if form == "sh" else None)
            operand = scale if form == "sh" else s
            out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
            gemm(x, w, bias, operand, out)
            outs[f"{name}_{form}"] = out.clone()
            err[f"{name}_{form}"] = float((out.double() - ref).norm() / ref.norm())
            fns[f"{name}_{form}"] = (lambda g=gemm, o=out, op=operand: g(x, w, bias, op, o))
    for name, form in (("prepared_cute", "fused_cute"),
                       ("prepared_pingpong", "fused_cute_pingpong")):
        prep = PreparedLoraLinear(w, bias, down, up, form)
        fns[name] = (lambda p=prep: p(x, scale))
    equal = {form: bool(torch.equal(outs[f"p192_{form}"], outs[f"c192_{form}"]))
             for form in ("sg", "sh")}
    with torch.no_grad():
        graphs = {q: harness.graphed(_burst(fn), warmup=1) for q, fn in fns.items()}
        timed = harness.interleaved({q: (lambda i, g=g: g.replay()) for q, g in graphs.items()},
                                    rounds=rounds, warmup=2)
    us = {q: 1e3 * v["median_ms"] / BURST for q, v in timed.items()}
    return {"shape": (t, k, n, r), "us": us,
            "pct_over_base": {q: 100 * (v - us["base"]) / us["base"] for q, v in us.items()},
            "rel_err_vs_float64": err, "pingpong_equals_cooperative_192": equal}


def write(rows: dict) -> None:
    cols = ["cublas_kext", *(f"{q}_{f}" for f in ("sg", "sh") for q in TILES),
            "prepared_cute", "prepared_pingpong"]
    table = harness.markdown_table(
        ["shape", "(T, K, N, r)", "base us", *cols, "ping-pong = 128 x 192 (sg, sh)"],
        [[name, str(tuple(r["shape"])), f"{r['us']['base']:.1f}",
          *(f"{r['us'][c]:.1f} ({r['pct_over_base'][c]:+.1f}%)" if c in r["us"] else "-"
            for c in cols),
          " ".join(str(r["pingpong_equals_cooperative_192"][f]) for f in ("sg", "sh"))]
         for name, r in rows.items()])
    notes = ("Microseconds per call in CUDA graphs of "
             f"{BURST} calls (medians of interleaved rounds), and the overhead over the base "
             "GEMM. c256 / c192: the cooperative tiles (two warpgroups share each tile); p192: "
             "the ping-pong tile (each warpgroup its own tiles, main loops and epilogues in "
             "turn). sg: S given (the GEMM alone); sh: S tiles among the kernel's units. "
             "prepared_*: Triton's shrink, then the GEMM (the fused_cute and "
             "fused_cute_pingpong tiers' call). Last column: the ping-pong tile's outputs "
             "equal to the cooperative 128 x 192 tile's, bit for bit.")
    harness.write_results("cute_tiles", {"shapes": rows}, table,
                          "The CuTe LoRA GEMM's tiles (benchmarks/cute_tiles.py)", notes)
    print(table)


def main() -> None:
    if not cute_available():
        raise SystemExit("needs the hopper extra (nvidia-cutlass-dsl) on an sm_90 GPU")
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    rows: dict = {}
    for name, shape in SHAPES.items():
        rows[name] = bench_shape(*shape, rounds=rounds)
        write(rows)


if __name__ == "__main__":
    main()
