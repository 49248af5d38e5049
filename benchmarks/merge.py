"""Merge throughput: a rank-64 LoRA folded into a few GB of bf16 weights.

Variants, interleaved in one run:
    shuttle      shuttle.merge_lora end to end, an adapter merged into this model before: the
                 remembered launches replayed (shuttle.apply.recipe; a server switching
                 between adapters, or apply_lora(mode="merge") per request)
    shuttle_prepared  the same without the recipe (forgotten before each call): the launches
                 prepared again, one per group of up to MAX_GROUP same-shaped weights (the
                 placement and the tensors' finiteness still remembered)
    shuttle_cold shuttle.merge_lora of an adapter object never seen before (fresh tensors):
                 resolution, shape checks and the finite scan of every adapter tensor timed too
    naive_fp32   per weight: W.float(), addmm_ in float32, cast back (the float32 round trip)
    peft         PEFT merge_adapter() (delta in bf16, then added: two roundings); unmerged
                 untimed between rounds
    cublas_addmm W.addmm_(B, A) per weight, no validation: the in-place cuBLAS speed, but it
                 rounds the scaled product to bf16 before adding (two roundings)
    copy         a device copy of the same bytes (read + write): the memory ceiling
GB/s counts the weight bytes read plus written (2 x 2 bytes per element). Accuracy: elements of
one merged weight that differ from float64 math rounded once to bf16.

Run on the GPU machine: ``python benchmarks/merge.py``.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import shuttle  # noqa: E402


class Stack(nn.Module):
    def __init__(self, n: int, out_f: int, in_f: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(in_f, out_f, bias=False) for _ in range(n))

    def forward(self, x):
        return [layer(x) for layer in self.layers]


def make_lora(n: int, out_f: int, in_f: int, rank: int, alpha: float, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sd = {}
    for j in range(n):
        sd[f"layers.{j}.lora_A.weight"] = (torch.randn(rank, in_f, device="cuda", generator=g)
                                           / in_f**0.5).bfloat16()
        sd[f"layers.{j}.lora_B.weight"] = (torch.randn(out_f, rank, device="cuda", generator=g)
                                           * 0.02).bfloat16()
        sd[f"layers.{j}.alpha"] = torch.tensor(alpha)
    return sd


def ulp_error(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(fraction of elements != ref, max |got - ref| in ulps of ref)."""
    spacing = (torch.nextafter(ref, torch.full_like(ref, torch.inf)).double() - ref.double()).abs()
    diff = (got.double() - ref.double()).abs() / spacing
    return float((got != ref).double().mean().item()), float(diff.max().item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", type=int, default=12288)
    ap.add_argument("--inp", type=int, default=3072)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--max-group", type=int, default=None,
                    help="weights per fused-merge launch (default: the library's MAX_GROUP)")
    ap.add_argument("--kernel-config", default=None,
                    help='(BM, BN, warps) for the fused kernel, e.g. "(64, 128, 8)" '
                         "(benchmarks/tune_merge_kernel.py writes the best)")
    args = ap.parse_args()
    # The module: ``import shuttle.kernels.merge_lowrank`` would give the function of the
    # same name that shuttle.kernels re-exports, and setting its attribute changes nothing.
    mk = importlib.import_module("shuttle.kernels.merge_lowrank")
    if args.kernel_config:
        import ast

        mk.CUDA_CONFIG = tuple(ast.literal_eval(args.kernel_config))
    if args.max_group:
        mk.MAX_GROUP = args.max_group
    max_group = mk.MAX_GROUP
    n, out_f, in_f, rank, alpha = args.layers, args.out, args.inp, args.rank, 32.0
    scale = alpha / rank
    torch.manual_seed(0)
    model = Stack(n, out_f, in_f).cuda().bfloat16()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sds = [make_lora(n, out_f, in_f, rank, alpha, seed) for seed in (1, 2)]
    loras = [shuttle.load_lora(sd) for sd in sds]

    # Accuracy on layer 0, from the same starting weight.
    w0 = model.layers[0].weight.detach().clone()
    torch.set_grad_enabled(False)
    a, b = sds[0]["layers.0.lora_A.weight"], sds[0]["layers.0.lora_B.weight"]
    ref = (w0.double() + scale * (b.double() @ a.double())).bfloat16()
    probe = Stack(1, out_f, in_f).cuda().bfloat16()
    probe.layers[0].weight.data.copy_(w0)
    one = shuttle.load_lora({k: v for k, v in sds[0].items() if k.startswith("layers.0.")})
    shuttle.merge_lora(probe, [(one, 1.0)])
    acc = {"shuttle": ulp_error(probe.layers[0].weight, ref)}
    w32 = w0.float()
    w32.addmm_(b.float(), a.float(), alpha=scale)
    acc["shuttle_cold"] = acc["shuttle_prepared"] = acc["shuttle"]
    acc["naive_fp32"] = ulp_error(w32.bfloat16(), ref)
    acc["peft"] = ulp_error(w0 + (b @ a) * scale, ref)
    acc["cublas_addmm"] = ulp_error(w0.clone().addmm_(b, a, alpha=scale), ref)

    # PEFT on its own copy of the weights.
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    pmodel = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=["layers." + str(j) for j in range(n)],
        init_lora_weights=False))
    set_peft_model_state_dict(pmodel, {f"base_model.model.{k}": v for k, v in sds[0].items()
                                       if "lora_" in k})
    pmodel.cuda()

    layers = list(model.layers)
    src = torch.empty(weight_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)

    def run_shuttle(i: int) -> None:
        shuttle.merge_lora(model, [(loras[i % 2], 1.0)], progress=False)

    memo = shuttle.apply.memo_of(model)

    def run_prepared(i: int) -> None:
        memo.recipes.clear()  # placements and finite verdicts stay remembered
        shuttle.merge_lora(model, [(loras[i % 2], 1.0)], progress=False)

    def fresh_lora(i: int) -> shuttle.LoRA:
        return shuttle.load_lora({k: v.clone() for k, v in sds[i % 2].items()})

    cold = [fresh_lora(0)]

    def run_cold(i: int) -> None:
        shuttle.merge_lora(model, [(cold[0], 1.0)], progress=False)

    def run_naive(i: int) -> None:
        sd = sds[i % 2]
        with torch.no_grad():
            for j, layer in enumerate(layers):
                w = layer.weight.float()
                w.addmm_(sd[f"layers.{j}.lora_B.weight"].float(),
                         sd[f"layers.{j}.lora_A.weight"].float(), alpha=scale)
                layer.weight.copy_(w)

    def run_raw(i: int) -> None:
        sd = sds[i % 2]
        with torch.no_grad():
            for j, layer in enumerate(layers):
                layer.weight.addmm_(sd[f"layers.{j}.lora_B.weight"],
                                    sd[f"layers.{j}.lora_A.weight"], alpha=scale)

    def run_peft(i: int) -> None:
        pmodel.merge_adapter()

    def run_copy(i: int) -> None:
        dst.copy_(src)

    def between(name: str, i: int) -> None:
        if name == "peft":
            pmodel.unmerge_adapter()
        elif name == "shuttle_cold":
            cold[0] = fresh_lora(i + 1)

    variants = {"shuttle": run_shuttle, "shuttle_prepared": run_prepared,
                "shuttle_cold": run_cold, "naive_fp32": run_naive,
                "peft": run_peft, "cublas_addmm": run_raw, "copy": run_copy}
    timings = harness.interleaved(variants, rounds=args.rounds, between=between)
    # The kernels' own time (profiler), apart from the host's: where an end-to-end time above
    # it comes from the host (planning, issuing), not from the GPU.
    kernel_ms = {k: harness.gpu_ms(variants[k])
                 for k in ("shuttle", "shuttle_prepared", "cublas_addmm", "copy")}
    # and the host's time to issue one call (where above the GPU time, the host sets the pace)
    host = {k: harness.host_ms(variants[k]) for k in ("shuttle", "shuttle_prepared")}
    gbs = {k: 2 * weight_bytes / (v["median_ms"] * 1e-3) / 1e9 for k, v in timings.items()}
    rows = []
    for k in variants:
        frac, ulp = acc.get(k, (float("nan"), float("nan")))
        rows.append([k, f"{timings[k]['median_ms']:.3f}",
                     f"{kernel_ms[k]:.3f}" if k in kernel_ms else "-",
                     f"{host[k]:.3f}" if k in host else "-", f"{gbs[k]:.0f}",
                     f"{gbs[k] / gbs['shuttle']:.2f}", "-" if k == "copy" else f"{frac:.3%}",
                     "-" if k == "copy" else f"{ulp:.1f}"])
    table = harness.markdown_table(
        ["variant", "median ms", "GPU kernels ms", "host ms", "GB/s (W read+write)", "vs shuttle",
         "elements != float64 single rounding", "max err (ulp)"], rows)
    notes = (f"kernel {mk.CUDA_CONFIG} (BM, BN, warps), up to {max_group} weights a launch; "
             f"{n} bf16 weights of {out_f}x{in_f} "
             f"({weight_bytes / 1e9:.2f} GB), rank {rank}, "
             f"alpha {alpha:g}; {args.rounds} interleaved rounds (each in its own order) after "
             "3 warm-up, median; two adapters alternate between rounds (shuttle: their "
             "remembered launches replayed; shuttle_prepared: the launches prepared again; "
             "shuttle_cold: a new adapter object with new tensors each round). GPU kernels "
             "ms: the profiled kernel time of one call (mean of 5), without the host's; host "
             "ms: the host time to issue one call (median of 20, the GPU drained before each). "
             "Target: shuttle >= 1500 GB/s with a single rounding.")
    path = harness.write_results("merge", {"config": vars(args), "timings": timings,
                                           "gb_per_s": gbs, "accuracy": acc,
                                           "kernel_ms": kernel_ms, "host_ms": host}, table,
                                 "Merge throughput (benchmarks/merge.py)", notes)
    print(table)
    print(notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
