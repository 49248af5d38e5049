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

Second section (``--dynamic``, CUDA): the overhead of a dynamic rank-64 LoRA (lossless tier)
over each quantized layer's own forward, at a DiT FFN shape (4096 tokens, 3072 -> 12288) and
an LLM decode shape (16 tokens, 4096 -> 14336): bf16 (reference), float8 e4m3 through
``shuttle.upcast_on_use``, GGUF Q8_0 and Q4_K (``GGUFParameter``), and, where the library is
installed, bitsandbytes NF4 and int8, torchao float8 (weight-only and dynamic-activation
per-row) and int8 weight-only, optimum-quanto qint8 and qfloat8. Per layer kind the base
forward and the forward with the adapter attached alternate (two modules sharing the stored
weight); medians of interleaved rounds.

Streaming a float8 Flux-like model against bf16 is ``benchmarks/offload.py --storage
bf16,fp8 --out offload_fp8``.

    python benchmarks/quantized.py --dynamic             # on the GPU machine
    python benchmarks/quantized.py --rows 256 --cols 256 --rounds 2   # smoke (CPU interpreter)
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import shuttle  # noqa: E402
from shuttle.weights import Fp8Weight, GGUFParameter  # noqa: E402
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
    gpu = {}
    if DEVICE == "cuda":  # kernel time alone: what the merge costs once host work overlaps
        gpu = {f"{v}_{q}": harness.gpu_ms(lambda i, fn=fn, q=q: fn(i, q)) for v, fn in
               (("triton", triton), ("reference", reference)) for q in ("nearest", "stochastic")}
    return {"timings": timings, "errors": err, "gpu_ms": gpu,
            "speedup": timings["reference"]["median_ms"] / timings["triton"]["median_ms"]}


# -- where the merge time goes ---------------------------------------------------------------
SWEEP = [(16, 128, 4), (32, 128, 4), (32, 256, 4), (64, 128, 4), (64, 128, 8), (64, 256, 8),
         (128, 128, 8)]


def sweep_calls(fmt: str, rep, adapters, alpha: list[float]) -> dict[str, Callable]:
    """The calls :func:`sweep` times for one format: each kernel config, the representation's
    merge (kernel plus checks) and the reference path."""
    from shuttle.kernels.merge_nf4 import merge_4bit
    from shuttle.kernels.merge_scaled import merge_scaled

    r = adapters[0][0].shape[1]
    calls: dict[str, Callable] = {}
    scale = None if fmt == "nf4" else rep.scb if fmt == "int8_rowwise" else rep.scale
    for c in SWEEP:
        if fmt == "nf4":
            calls[str(c)] = lambda i, c=c: merge_4bit(
                rep.packed, rep.absmax, rep.code, rep.shape, rep.blocksize, *adapters[i % 2],
                [0, r], alpha, config=c)
        else:
            calls[str(c)] = lambda i, c=c: merge_scaled(
                rep.data, scale, *adapters[i % 2], [0, r], alpha, config=c,
                absmax_scale=fmt == "int8_rowwise")
    calls["rep.merge_lowrank"] = lambda i: rep.merge_lowrank(*adapters[i % 2], [0, r], alpha,
                                                              seed=i)

    def reference(i: int):
        up, down = adapters[i % 2]
        return rep.encode(rep.dequantize() + alpha[0] * (up.float() @ down.float()))

    calls["reference"] = reference
    return calls


def sweep(w: torch.Tensor, adapters, alpha: list[float], rounds: int,
          formats: tuple[str, ...] = ("fp8_rowwise", "int8_rowwise", "nf4")) -> dict:
    """Per kernel config: end-to-end ms of one call and its GPU kernel time (fp8 row-wise via
    merge_scaled, NF4 via merge_4bit), next to the representation's merge and the reference
    path."""
    out: dict = {}
    for fmt in formats:
        calls = sweep_calls(fmt, encoded(fmt, w), adapters, alpha)
        t = harness.interleaved(calls, rounds=rounds, warmup=2)
        out[fmt] = {k: {"end_to_end_ms": t[k]["median_ms"], "gpu_ms": harness.gpu_ms(f),
                        "host_ms": harness.host_ms(f)} for k, f in calls.items()}
        for k, v in out[fmt].items():
            print(f"[sweep] {fmt} {k}: {v['end_to_end_ms']:.3f} ms end to end, "
                  f"{v['gpu_ms']:.3f} ms GPU, {v['host_ms']:.3f} ms host", flush=True)
    return out


# -- dynamic LoRA over quantized layers ----------------------------------------------------
DYNAMIC_SHAPES = {"dit_ffn": (4096, 3072, 12288), "llm_decode": (16, 4096, 14336)}


class Holder(nn.Module):
    """One layer under the name ``proj`` (what the adapter's keys target)."""

    def __init__(self, proj: nn.Module):
        super().__init__()
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def gguf_raw(qtype: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random GGUF blocks of an (n, k) weight with small fixed super-block scales."""
    block, values = {"Q8_0": (34, 32), "Q4_K": (144, 256)}[qtype]
    raw = torch.randint(0, 256, (n * k // values, block), dtype=torch.uint8, device=DEVICE,
                        generator=g)
    d = torch.tensor([2e-3, 1e-3], dtype=torch.float16).view(torch.uint8).to(DEVICE)
    raw[:, :2] = d[:2]  # d (Q8_0, Q4_K)
    if qtype == "Q4_K":
        raw[:, 2:4] = d[2:]  # dmin
    return raw.view(n, -1)


def quantized_layers(w: torch.Tensor, g: torch.Generator
                     ) -> dict[str, Callable[[], nn.Module]]:
    """Builders of an (n, k) layer per representation, on the device, from bf16 ``w``."""
    n, k = w.shape

    def plain() -> nn.Module:
        lin = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=DEVICE)
        lin.weight.data.copy_(w)
        return lin.requires_grad_(False)

    def fp8() -> nn.Module:
        lin = plain()
        lin.weight = nn.Parameter(w.to(torch.float8_e4m3fn), requires_grad=False)
        return lin  # computes through shuttle.upcast_on_use (installed per module below)

    def gguf(qtype: str) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            lin = plain()
            lin.weight = GGUFParameter(gguf_raw(qtype, n, k, g), qtype, (n, k))
            return lin
        return build

    def bnb4() -> nn.Module:
        import bitsandbytes as bnb
        m = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        m.weight = bnb.nn.Params4bit(w.cpu(), requires_grad=False, quant_type="nf4")
        return m.to(DEVICE)  # quantizes

    def bnb8() -> nn.Module:
        import bitsandbytes as bnb
        m = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False, threshold=0.0)
        m.weight = bnb.nn.Int8Params(w.cpu(), requires_grad=False, has_fp16_weights=False)
        return m.to(DEVICE)  # quantizes

    def torchao(config: str) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            import torchao.quantization as q
            cfg = {"f8_weight_only": q.Float8WeightOnlyConfig(),
                   "f8_dynamic_rowwise": q.Float8DynamicActivationFloat8WeightConfig(
                       granularity=q.PerRow()),
                   "i8_weight_only": q.Int8WeightOnlyConfig()}[config]
            m = Holder(plain())
            q.quantize_(m, cfg)
            return m.proj
        return build

    def quanto(weights: str) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            from optimum import quanto as oq
            m = Holder(plain())
            oq.quantize(m, weights=getattr(oq, weights))
            oq.freeze(m)
            return m.proj
        return build

    return {"bf16": plain, "fp8_e4m3 (upcast)": fp8, "gguf_q8_0": gguf("Q8_0"),
            "gguf_q4_k": gguf("Q4_K"), "bnb_nf4": bnb4, "bnb_int8": bnb8,
            "torchao_f8_weight_only": torchao("f8_weight_only"),
            "torchao_f8_dynamic_rowwise": torchao("f8_dynamic_rowwise"),
            "torchao_i8_weight_only": torchao("i8_weight_only"),
            "quanto_qint8": quanto("qint8"), "quanto_qfloat8": quanto("qfloat8")}


def twin(layer: nn.Module) -> nn.Module:
    """A second module over the same stored weight (own parameter dict, so its hooks and
    adapters are its own)."""
    other = copy.copy(layer)
    other._parameters = dict(layer._parameters)
    other._buffers = dict(layer._buffers)
    other._modules = dict(layer._modules)
    return other


def bench_dynamic(rank: int, rounds: int) -> dict:
    """Base forward vs forward with a dynamic LoRA, per representation and shape."""
    out: dict = {}
    for shape_name, (t, k, n) in DYNAMIC_SHAPES.items():
        g = torch.Generator(device=DEVICE).manual_seed(1)
        w = (torch.randn(n, k, device=DEVICE, generator=g) * 0.02).bfloat16()
        lora = shuttle.load_lora({
            "proj.lora_A.weight": (torch.randn(rank, k, device=DEVICE, generator=g)
                                   / k**0.5).bfloat16(),
            "proj.lora_B.weight": (torch.randn(n, rank, device=DEVICE, generator=g)
                                   * 0.02).bfloat16()})
        xs = [torch.randn(t, k, device=DEVICE, generator=g).bfloat16() for _ in range(3)]
        out[shape_name] = {}
        for kind, build in quantized_layers(w, g).items():
            try:
                layer = build()
                base, adapted = Holder(layer), Holder(twin(layer))
                if kind.startswith("fp8"):
                    shuttle.upcast_on_use(base)
                    shuttle.upcast_on_use(adapted)
                handle = shuttle.attach_lora(adapted, [(lora, 1.0)], quality="lossless")
                with torch.no_grad():
                    res = harness.interleaved(
                        {"base": lambda i, m=base, xs=xs: m(xs[i % 3]),
                         "lora": lambda i, m=adapted, xs=xs: m(xs[i % 3])},
                        rounds=rounds, warmup=3)
                handle.detach()
                res["overhead"] = res["lora"]["median_ms"] / res["base"]["median_ms"] - 1
                out[shape_name][kind] = res
                print(f"[dynamic] {shape_name} {kind}: base {res['base']['median_ms']:.3f} ms, "
                      f"+lora {100 * res['overhead']:+.1f}%", flush=True)
            except ImportError as e:
                out[shape_name][kind] = {"skipped": f"not installed: {e.name}"}
            except Exception as e:  # one failing kind must not cost the others their rows
                traceback.print_exc()
                out[shape_name][kind] = {"error": f"{type(e).__name__}: {e}"}
            finally:
                torch.cuda.empty_cache()
    return out


def dynamic_table(res: dict) -> str:
    rows = []
    kinds = list(next(iter(res.values())))
    for kind in kinds:
        row = [kind]
        for shape_name in res:
            r = res[shape_name][kind]
            if "overhead" in r:
                bf16 = res[shape_name]["bf16"].get("base", {}).get("median_ms")
                row += [f"{r['base']['median_ms']:.3f}"
                        + (f" ({r['base']['median_ms'] / bf16:.2f}x bf16)" if bf16 else ""),
                        f"{100 * r['overhead']:+.1f}%"]
            else:
                row += [r.get("skipped") or r.get("error", "-"), "-"]
        rows.append(row)
    headers = ["layer"]
    for shape_name, (t, k, n) in DYNAMIC_SHAPES.items():
        headers += [f"{shape_name} ({t}x{k} -> {n}) base ms", "+ LoRA"]
    return harness.markdown_table(headers, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=12288)
    ap.add_argument("--cols", type=int, default=3072)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--dynamic", action="store_true",
                    help="also the dynamic-LoRA overhead over quantized layers (CUDA)")
    ap.add_argument("--dynamic-rounds", type=int, default=30)
    ap.add_argument("--sweep", action="store_true",
                    help="also kernel configs and GPU-only times (CUDA)")
    ap.add_argument("--sweep-formats", default="fp8_rowwise,int8_rowwise,nf4",
                    help="comma-separated formats the sweep covers")
    args = ap.parse_args()
    m, n, r = args.rows, args.cols, args.rank
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w = torch.randn(m, n, device=DEVICE, generator=g).bfloat16().float()
    adapters = [((torch.randn(m, r, device=DEVICE, generator=g) * 0.02).bfloat16(),
                 (torch.randn(r, n, device=DEVICE, generator=g) / n**0.5).bfloat16())
                for _ in range(2)]
    alpha = [0.5]
    results, rows = {}, []
    harness.spin_up()
    for fmt in ("fp8_rowwise", "int8_rowwise", "nf4"):
        try:
            res = bench_format(encoded(fmt, w), adapters, alpha, args.rounds)
        except Exception as e:  # one failing format must not cost the others their rows
            traceback.print_exc()
            results[fmt] = {"error": f"{type(e).__name__}: {e}"}
            rows.append([fmt, "error", "-", "-", "-", "-", "-", "-", "-", "-"])
            continue
        if res is None:
            print(f"{fmt}: no fused kernel applies; skipped", flush=True)
            continue
        results[fmt] = res
        t, err = res["timings"], res["errors"]
        gpu = res["gpu_ms"]
        gpu_cells = [f"{gpu[f'triton_{q}']:.3f} / {gpu[f'reference_{q}']:.3f} "
                     f"({gpu[f'reference_{q}'] / gpu[f'triton_{q}']:.1f}x)"
                     for q in ("nearest", "stochastic")] if gpu else ["-", "-"]
        rows.append([fmt, f"{t['triton']['median_ms']:.3f}", f"{t['reference']['median_ms']:.3f}",
                     f"{res['speedup']:.1f}x", *gpu_cells, f"{err['triton_nearest']['rms']:.2e}",
                     f"{err['triton_stochastic']['rms']:.2e}",
                     f"{err['triton_stochastic']['mean']:+.1e}",
                     f"{err['reference_nearest']['rms']:.2e}"])
        print(rows[-1], flush=True)
    sweep_res = sweep(w, adapters, alpha, args.rounds, tuple(args.sweep_formats.split(","))) \
        if args.sweep and DEVICE == "cuda" else None
    del w, adapters
    table = harness.markdown_table(
        ["format", "triton ms", "reference ms", "speedup", "GPU ms nearest: triton / reference",
         "GPU ms stochastic: triton / reference", "rms err nearest",
         "rms err stochastic", "mean err stochastic", "reference rms err nearest"], rows)
    notes = (f"Merge: one {m}x{n} weight, rank-{r} adapters (alpha {alpha[0]}) alternating; "
             f"medians of {args.rounds} interleaved rounds. Errors: the merged weight "
             "dequantized, against the float64 sum of the dequantized weight and the update. "
             "Speedup: end to end per call (host work and the finiteness check's sync "
             "included), nearest rounding; GPU ms: kernel time alone (profiler). Target: >= 10x.")
    payload: dict = {"shape": [m, n], "rank": r, "formats": results}
    if sweep_res is not None:
        payload["sweep"] = sweep_res
        table += "\n\n" + harness.markdown_table(
            ["format", "variant", "end to end ms", "GPU ms", "host ms"],
            [[f, k, f"{v['end_to_end_ms']:.3f}", f"{v['gpu_ms']:.3f}", f"{v['host_ms']:.3f}"]
             for f, d in sweep_res.items() for k, v in d.items()])
    if args.dynamic and DEVICE == "cuda":
        payload["dynamic"] = bench_dynamic(r, args.dynamic_rounds)
        table += "\n\n" + dynamic_table(payload["dynamic"])
        notes += (f" Dynamic: rank-{r} LoRA, lossless tier, over each layer's own forward; "
                  f"medians of {args.dynamic_rounds} interleaved rounds; base ms in brackets "
                  "relative to the bf16 layer.")
    harness.write_results("quantized", payload, table,
                          "Quantized weights: fused merges and dynamic LoRA "
                          "(benchmarks/quantized.py)", notes)
    print(table)
    print(notes)


if __name__ == "__main__":
    main()
