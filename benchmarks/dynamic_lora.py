"""Dynamic LoRA overhead over the base linear, at the shapes of h200-limits.md, one interleaved run.

Per shape (tokens T, in K, out N, rank r), bf16 with bias:
    base      the nn.Linear alone
    naive     delta = x @ A.T @ B.T materialized, scaled by alpha/r then strength, added
    lossless  shuttle.attach_lora(quality="lossless"): scale on the rank-wide intermediate,
              addmm_ onto the base output
    fused     quality="fused" kept to Triton's kernels: the shrink, then one kernel for
              x W^T + S B^T
    cute      quality="fused" with the CuTe-DSL Hopper GEMM for the second kernel (the hopper
              extra; the K loop extended by the rank); absent without the extra
    cute1     one CuTe kernel, the shrink among its own work units (S tiles ahead of the
              output tiles reading them: x read from memory once; ranks up to 128)
    auto      quality="auto", the default: the tier chooser's measured pick per shape
    wide      an experiment, not a tier: one cuBLAS GEMM over [W; A] (the factor stored beside
              the weight: x read once, where the fused tiers read it twice, in the shrink and
              in the GEMM), then the scale on the rank columns and addmm_ of them onto the
              output columns in place (lossless's roundings; the output keeps the row stride
              N + r). Where K >> N (an FFN's down projection) x is the larger operand.
    floor     max(extra bytes / copy bandwidth, extra FLOPs / GEMM rate) over the base time,
              with the ceilings of h200-limits.md (4213 GB/s read+write, 780 TFLOP/s)
Then a whole small DiT forward (LoRA on every linear): merged vs each tier, eagerly, in a CUDA
graph, and the host's time to issue one forward (above the graph's time, the eager forward is
bound by the host), with the tier chooser's measurements and picks at its layers' shapes.
Every variant is timed four ways: eager (one call from an idle GPU, host time included), eager
in bursts (BURST calls back to back between two events, per call: what a model's forward does,
the host launching ahead while the GPU works; what the tier chooser measures), captured in a
CUDA graph (GPU work only, one call per replay) and BURST calls captured in one graph (GPU work
at the clocks a chain of layers sustains).

Writes docs/benchmarks/dynamic_lora.{json,md} after every shape (a cut-off run keeps its rows).

    python benchmarks/dynamic_lora.py 8                          # every shape, then the DiT
    python benchmarks/dynamic_lora.py 8 --shapes llm_8b_decode_qkv \
        --rows-from docs/benchmarks/dynamic_lora.json           # one row anew, the rest kept

With --shapes only those shapes run (no DiT); --rows-from keeps an earlier run's other rows and
its DiT, each naming the run it came from.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import shuttle  # noqa: E402
from shuttle.apply.tier import TIERS as CHOOSER  # noqa: E402
from shuttle.apply.tier import row_bucket  # noqa: E402

SHAPES = {
    "wan1.3b_attn": (32760, 1536, 1536, 128),
    "wan1.3b_ffn_up": (32760, 1536, 8960, 128),
    "wan1.3b_ffn_down": (32760, 8960, 1536, 128),
    "zimage_attn": (4352, 3840, 3840, 32),
    "zimage_ffn_up": (4352, 3840, 10240, 32),
    "llm_8b_decode_qkv": (16, 4096, 6144, 16),
    "llm_8b_prefill_mlp": (8192, 4096, 14336, 16),
}
COPY_GBS, GEMM_TFLOPS = 4213.0, 780.0
BURST = 10  # calls per timed burst, as the tier chooser times them (shuttle.apply.tier)
# One call from an idle GPU spreads most (its clocks, the host's launches): the eager column
# takes this many times the rounds of the others (cheap: one call each), and where calls are
# short (a decode step: host jitter is a large share of one call) as many rounds as fit in
# EAGER_SECONDS of timing per shape, up to EAGER_MAX_ROUNDS.
EAGER_ROUNDS = 4
EAGER_SECONDS = 1.0
EAGER_MAX_ROUNDS = 1000


def eager_rounds(variants: dict, rounds: int) -> int:
    """Rounds of the eager column for ``variants``: a round of one call each, timed once
    after an untimed one (auto's first call at a shape runs the tier chooser's measurement).
    """
    for fn in variants.values():
        harness.time_once(fn, 0)
    start = time.perf_counter()
    for fn in variants.values():
        harness.time_once(fn, 0)
    per_round = time.perf_counter() - start
    return max(EAGER_ROUNDS * rounds, min(EAGER_MAX_ROUNDS, int(EAGER_SECONDS / per_round)))


# The dynamic variants: name -> (quality, whether the CuTe kernel may run)
TIERS = {"lossless": ("lossless", False), "fused": ("fused", False), "cute": ("fused", True),
         "cute1": ("fused", "fused_cute_shrink"), "cutepp": ("fused", "fused_cute_pingpong"),
         "auto": ("auto", True)}


def tiers() -> dict[str, tuple[str, bool]]:
    """The variants this machine runs (cute only with the extra on an sm_90 GPU)."""
    from shuttle.kernels.lora_linear_cute import cute_available

    return {q: v for q, v in TIERS.items() if not q.startswith("cute") or cute_available()}


def attach(model: nn.Module, sd: dict, strength: float, variant: tuple[str, bool]):
    quality, cute = variant
    handle = shuttle.attach_lora(model, [(sd, strength)], quality=quality)
    for hook in handle.hooks.values():
        hook.allow_cute = bool(cute)
        if isinstance(cute, str):
            hook.cute_form = cute
    return handle


def floor_ms(t: int, k: int, n: int, r: int) -> float:
    extra_bytes = 2 * t * k + 2 * 2 * t * r  # re-read x; write and read x A^T (bf16)
    extra_flops = 2 * t * r * (k + n)
    return max(extra_bytes / (COPY_GBS * 1e9), extra_flops / (GEMM_TFLOPS * 1e12)) * 1e3


def adapter(k: int, n: int, r: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"0.lora_A.weight": (torch.randn(r, k, device="cuda", generator=g)
                                / k**0.5).bfloat16(),
            "0.lora_B.weight": (torch.randn(n, r, device="cuda", generator=g) * 0.02).bfloat16(),
            "0.alpha": torch.tensor(float(r) / 2)}


def bench_shape(name: str, t: int, k: int, n: int, r: int, rounds: int) -> dict:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(k, n)).cuda().bfloat16()
    variants_of = tiers()
    mods = {q: nn.Sequential(nn.Linear(k, n)).cuda().bfloat16() for q in variants_of}
    for m in mods.values():
        m.load_state_dict(base.state_dict())
    sd = adapter(k, n, r, 1)
    xs = [torch.randn(t, k, device="cuda").bfloat16() for _ in range(2)]
    handles = {q: attach(m, sd, 0.8, variants_of[q]) for q, m in mods.items()}
    a, b, s = sd["0.lora_A.weight"], sd["0.lora_B.weight"], 0.5

    def naive_on(x):
        d = x @ a.T @ b.T
        d = d * s
        d = d * 0.8
        return base(x) + d

    def naive(i):
        return naive_on(xs[i % 2])

    lin = base[0]
    wcat = torch.cat([lin.weight.detach(), a]).contiguous()  # (N + r, K)
    bcat = torch.cat([lin.bias.detach(), lin.bias.new_zeros(r)])
    wide_scale = torch.full((r,), 0.8 * s, device="cuda", dtype=torch.float32)

    def wide_on(x):
        y = F.linear(x, wcat, bcat)  # [x W^T + bias | x A^T]
        out, h = y[:, :n], y[:, n:]
        h.mul_(wide_scale)  # float32 math, rounded once, in place
        return out.addmm_(h, b.T)  # onto the output columns (ld = N + r)

    variants = {"base": lambda i: base(xs[i % 2]), "naive": naive,
                "wide": lambda i: wide_on(xs[i % 2]),
                **{q: (lambda i, m=m: m(xs[i % 2])) for q, m in mods.items()}}
    names = ["naive", "wide", *mods]
    with torch.no_grad():
        timings = harness.interleaved(variants, rounds=eager_rounds(variants, rounds), warmup=3)
        bursts = harness.interleaved(
            {q: (lambda i, fn=fn: [fn(i + j) for j in range(BURST)]) for q, fn in variants.items()},
            rounds=rounds, warmup=3)
        burst = {q: {k: v / BURST for k, v in t.items() if k.endswith("_ms")}
                 for q, t in bursts.items()}
        ref = (xs[0].double() @ lin.weight.double().T + lin.bias.double()
               + 0.8 * s * (xs[0].double() @ a.double().T @ b.double().T))
        err = {q: float((variants[q](0).double() - ref).norm() / ref.norm())
               for q in names}
    # The same variants captured in CUDA graphs and replayed: the GPU work alone, without the
    # host's Python and launch time (as a server or torch.compile's cudagraphs run a layer).
    # One graph per variant and input, so that inputs rotate without a copy in the timed span.
    layers = {"base": base, "naive": lambda v: naive_on(v), "wide": lambda v: wide_on(v), **mods}
    graph = graph_burst = None
    try:
        graphs = {q: [harness.graphed(lambda m=m, x=x: m(x)) for x in xs]
                  for q, m in layers.items()}
        with torch.no_grad():
            graph = harness.interleaved(
                {q: (lambda i, g=g: g[i % 2].replay()) for q, g in graphs.items()},
                rounds=rounds, warmup=3)
        del graphs
        # BURST calls in one graph (burst_of: the graph's pool holds two outputs at a time):
        # the clocks a chain of layers sustains, where a single replay after an idle gap runs
        # at the clocks the GPU boosts to first.
        graphs = {q: harness.graphed(burst_of(m, xs)) for q, m in layers.items()}
        with torch.no_grad():
            got = harness.interleaved({q: (lambda i, g=g: g.replay()) for q, g in graphs.items()},
                                      rounds=rounds, warmup=3)
        graph_burst = {q: {"median_ms": t["median_ms"] / BURST} for q, t in got.items()}
        del graphs
    except RuntimeError as e:  # a variant that cannot be captured: recorded, run goes on
        print(f"{name}: CUDA graph capture failed: {e}", flush=True)
    for h in handles.values():
        h.detach()
    t_base = timings["base"]["median_ms"]
    b_base = burst["base"]["median_ms"]
    if graph is not None:
        g_base = graph["base"]["median_ms"]
        graph = {"timings": graph,
                 "overhead_pct": {q: 100 * (graph[q]["median_ms"] - g_base) / g_base
                                  for q in names}}
    if graph_burst is not None:
        gb_base = graph_burst["base"]["median_ms"]
        graph_burst = {"timings": graph_burst,
                       "overhead_pct": {q: 100 * (graph_burst[q]["median_ms"] - gb_base) / gb_base
                                        for q in names}}
    picks = [p for p in chooser_picks(rows=t) if (p["n"], p["k"], p["r"]) == (n, k, r)]
    return {"shape": (t, k, n, r), "timings": timings, "rel_err_vs_float64": err,
            "graph": graph, "graph_burst": graph_burst, "burst_timings": burst, "picks": picks,
            "overhead_pct": {q: 100 * (timings[q]["median_ms"] - t_base) / t_base
                             for q in names},
            "burst_overhead_pct": {q: 100 * (burst[q]["median_ms"] - b_base) / b_base
                                   for q in names},
            "floor_pct": 100 * floor_ms(t, k, n, r) / t_base,
            "graph_floor_pct": (100 * floor_ms(t, k, n, r) / graph["timings"]["base"]["median_ms"]
                                if graph else None)}


def burst_of(layer, xs: list[torch.Tensor]):
    """BURST calls of ``layer``, inputs alternating, each output dropped once the next exists."""
    def run():
        out = None
        for j in range(BURST):
            out = layer(xs[j % 2])
        return out
    return run


def bench_dit(rounds: int) -> dict:
    from shuttle.cli.demo import DemoDiT

    torch.manual_seed(0)
    dims = {"channels": 16, "dim": 1536, "mlp": 6144, "depth": 4}
    variants_of = tiers()
    models = {q: DemoDiT(**dims).cuda().bfloat16() for q in ("merged", *variants_of)}
    for m in models.values():
        m.load_state_dict(models["merged"].state_dict())
    g = torch.Generator(device="cuda").manual_seed(2)
    sd = {}
    for name, mod in models["merged"].named_modules():
        if isinstance(mod, nn.Linear):
            sd[f"{name}.lora_A.weight"] = (torch.randn(64, mod.in_features, device="cuda",
                                                       generator=g) * 0.02).bfloat16()
            sd[f"{name}.lora_B.weight"] = (torch.randn(mod.out_features, 64, device="cuda",
                                                       generator=g) * 0.02).bfloat16()
    shuttle.merge_lora(models["merged"], [(sd, 1.0)])
    handles = [attach(models[q], sd, 1.0, v) for q, v in variants_of.items()]
    xs = [torch.randn(1, 16, 128, 128, device="cuda").bfloat16() for _ in range(2)]  # 4096 tok
    with torch.no_grad():
        timings = harness.interleaved({q: (lambda i, m=m: m(xs[i % 2])) for q, m in
                                       models.items()}, rounds=EAGER_ROUNDS * rounds, warmup=3)
        # the host's part: time to issue one forward from an idle GPU (no sync inside it)
        host = harness.interleaved({q: (lambda i, m=m: m(xs[i % 2])) for q, m in
                                    models.items()}, rounds=rounds, warmup=3, timer=_host_ms)
        graphs = {q: [harness.graphed(lambda m=m, x=x: m(x)) for x in xs]
                  for q, m in models.items()}
        graph = harness.interleaved({q: (lambda i, g=g: g[i % 2].replay()) for q, g in
                                     graphs.items()}, rounds=rounds, warmup=3)
    for h in handles:
        h.detach()
    return {"config": dims, "tokens": 4096, "rank": 64, "timings": timings,
            "graph_timings": graph, "host_timings": host, "picks": chooser_picks(rows=4096)}


def _host_ms(name: str, fn, i: int) -> float:
    """Milliseconds the host takes to issue ``fn(i)`` (what it queues runs on meanwhile)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(i)
    ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return ms


def chooser_picks(rows: int) -> list[dict]:
    """What the tier chooser measured and picked for every layer shape it saw at ``rows``
    rows: microseconds per call of each candidate, eagerly (bursts), in graphs, of host time
    and from an idle device."""
    def us(times: dict[str, float]) -> dict[str, float | None]:  # None: could not run so
        return {q: round(t * 1e6, 1) if t != float("inf") else None for q, t in times.items()}

    return [{"n": key.n, "k": key.k, "r": key.r, "bias": key.bias,
             "eager_us": us(choice.eager), "graph_us": us(choice.graphs),
             "host_us": us(choice.host), "idle_us": us(choice.idle),
             "eager_pick": choice.best(False), "graph_pick": choice.best(True)}
            for key, choice in CHOOSER.choices.items() if key.rows == row_bucket(rows)]


def _picks(picks: list[dict]) -> str:
    """The chooser's measurements and picks, one ``K->N: ...`` clause per key."""
    return "; ".join(
        f"{p['k']}->{p['n']}: " + ", ".join(
            f"{q} {_us(p['eager_us'].get(q))} | {_us(p['graph_us'].get(q))}"
            f" | {_us(p.get('host_us', {}).get(q))} | {_us(p.get('idle_us', {}).get(q))}"
            for q in p["eager_us"])
        + f" -> eager {p['eager_pick']}, graphs {p['graph_pick']}" for p in picks)


def _us(t: float | None) -> str:
    return "-" if t is None else f"{t:.0f}"


def write(rows: dict, dit: dict | None) -> None:
    names = [q for q in ("naive", "wide", *TIERS)
             if any(q in r["overhead_pct"] for r in rows.values())]
    table_rows = []
    for name, r in rows.items():
        o, g = r["overhead_pct"], (r.get("graph") or {}).get("overhead_pct")
        bo = r.get("burst_overhead_pct", {})
        gt = r.get("graph") and r["graph"]["timings"]["base"]["median_ms"]
        gb = (r.get("graph_burst") or {}).get("overhead_pct")
        table_rows.append([
            name + (" *" if r.get("run") else ""), str(r["shape"]),
            f"{r['timings']['base']['median_ms']:.3f}",
            *(f"{o[q]:.0f}" if q in o else "-" for q in names),
            *(f"{bo[q]:.0f}" if q in bo else "-" for q in names),
            f"{gt:.3f}" if g else "-", *(f"{g[q]:.0f}" if g and q in g else "-" for q in names),
            *(f"{gb[q]:.0f}" if gb and q in gb else "-" for q in names),
            f"{r['graph_floor_pct']:.1f}" if g else f"{r['floor_pct']:.1f}",
            *(f"{r['rel_err_vs_float64'][q]:.1e}" for q in names[1:]
              if q in r["rel_err_vs_float64"])])
    table = harness.markdown_table(
        ["shape", "(T, K, N, r)", "eager base ms", *(f"{q} %" for q in names),
         *(f"burst {q} %" for q in names), "graph base ms", *(f"{q} %" for q in names),
         *(f"graph burst {q} %" for q in names), "floor %",
         *(f"{q} err" for q in names[1:])], table_rows)
    notes = ("Overheads are (t - t_base) / t_base, medians of interleaved rounds. Eager: one call "
             "timed from an idle GPU (host Python and launch time included, as an eager script "
             f"runs a single layer; at least {EAGER_ROUNDS}x the rounds of the other columns, "
             f"short calls as many as fit in {EAGER_SECONDS:g} s a shape, up to "
             f"{EAGER_MAX_ROUNDS}: the JSON's rounds). Burst: "
             f"{BURST} calls back to back between two events, per call (a model's forward: "
             "the host launches ahead while the GPU works; what the tier chooser measures). "
             "Graph: the same layers captured in CUDA graphs and replayed "
             "(the GPU work alone, as a server, torch.compile's cudagraphs or a long chain of "
             "layers whose launches run ahead runs them), one call per replay. Graph burst: "
             f"{BURST} calls in one graph, per call (the clocks a chain of layers sustains; a "
             "single replay after an idle gap runs at the clocks the GPU boosts to first). "
             "Floor: against the graph base. "
             "fused: Triton's kernels; cute: the CuTe-DSL GEMM; cute1: one CuTe kernel, the "
             "shrink included; auto: the default's pick; "
             "wide: an experiment (one GEMM over [W; A], then the update onto the output "
             "columns), not a tier.")
    runs = {f"{r['run']['date']}, {r['run']['device']}, commit {r['run']['commit']}"
            for r in [*rows.values(), dit or {}] if r.get("run")}
    if runs:
        notes += ("\n\nRows marked * " + ("and the DiT forward " if dit and dit.get("run")
                                           else "") + "come from an earlier run ("
                  + "; ".join(sorted(runs)) + "), kept where this run did not measure them.")
    if dit:
        lines = []
        for label, t in (("eager", dit["timings"]), ("CUDA graph", dit.get("graph_timings")),
                         ("host time to issue it", dit.get("host_timings"))):
            if not t:
                continue
            m = t["merged"]["median_ms"]
            lines.append(f"{label}: merged {m:.2f} ms, " + ", ".join(
                f"{q} {t[q]['median_ms']:.2f} ms ({t[q]['median_ms'] / m:.2f}x)"
                for q in t if q != "merged"))
        notes += (f"\n\nWhole DiT forward ({dit['config']}, {dit['tokens']} tokens, LoRA rank "
                  f"{dit['rank']} on every linear): " + "; ".join(lines) + ".")
        if dit.get("picks"):
            notes += ("\n\nThe tier chooser's measurements at its layers' shapes (us per call, "
                      "eager bursts | graphs | host | idle) and picks: "
                      + _picks(dit["picks"]) + ".")
    shape_picks = {name: r["picks"] for name, r in rows.items() if r.get("picks")}
    if shape_picks:
        notes += ("\n\nThe tier chooser at the table's shapes (us per call, eager bursts | "
                  "graphs | host | idle) and its picks: " + "; ".join(
                      f"{name} {_picks(p)}" for name, p in shape_picks.items()) + ".")
    harness.write_results("dynamic_lora", {"shapes": rows, "dit": dit}, table,
                          "Dynamic LoRA overhead (benchmarks/dynamic_lora.py)", notes)
    print(table)
    print(notes)


RUN_KEYS = ("date", "device", "commit")  # what names the run a row came from


def earlier(path: Path | None) -> tuple[dict, dict | None]:
    """An earlier run's rows and DiT, each marked with the run it came from (or none)."""
    if path is None:
        return {}, None
    data = json.loads(path.read_text())
    run = {k: data["env"].get(k) for k in RUN_KEYS}
    rows = {name: {**r, "run": r.get("run") or run} for name, r in data["shapes"].items()}
    dit = data.get("dit")
    return rows, dit and {**dit, "run": dit.get("run") or run}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rounds", type=int, nargs="?", default=15)
    p.add_argument("--shapes", default="",
                   help=f"comma-separated names among {', '.join(SHAPES)} (default: all, then "
                        "the DiT forward; named shapes run without the DiT)")
    p.add_argument("--rows-from", type=Path, default=None,
                   help="an earlier run's json: its rows of shapes not run now, and its DiT "
                        "where the DiT is not run, are kept (each naming its run)")
    args = p.parse_args()
    names = [n for n in args.shapes.split(",") if n] or list(SHAPES)
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        p.error(f"unknown shapes {unknown}: choose among {', '.join(SHAPES)}")
    kept, kept_dit = earlier(args.rows_from)
    rows: dict = {}
    for name, shape in SHAPES.items():
        if name in names:
            rows[name] = bench_shape(name, *shape, rounds=args.rounds)
        elif name in kept:
            rows[name] = kept[name]
        write(rows, kept_dit)
    if not args.shapes:
        write(rows, bench_dit(args.rounds))


if __name__ == "__main__":
    main()
