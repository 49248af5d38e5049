"""Offloading a Flux-sized DiT: step time, peak VRAM, host memory and setup time per strategy.

The model is diffusers' FluxTransformer2DModel at its default config (19 double + 38 single
blocks, ~12B parameters) with random bf16 weights, or smaller with --layers/--single-layers.
Variants, each set up on a fresh copy of the same weights and timed alone (their setups cannot
share the GPU, so rounds are not interleaved across variants; the median of the rounds is kept):

    resident            model.to("cuda")
    shuttle_whole       ModelOffloader.activate("cuda"): whole model from pinned arenas
    shuttle_<B>GiB      ModelOffloader.activate("cuda", StreamConfig(prefetch, vram_budget=B GiB))
    diffusers_group     enable_group_offload(block_level, 1 block/group, use_stream=True,
                        record_stream=True), when diffusers is importable
    accelerate_cpu      accelerate.cpu_offload, when importable (slow: few rounds)

Reported per variant: median step ms (one transformer forward), peak VRAM (GiB), pinned/host
bytes (shuttle: exact registrations; others: process RSS after setup), setup seconds.

    python benchmarks/offload.py                          # full Flux on the GPU machine
    python benchmarks/offload.py --layers 4 --single-layers 8 --budgets 2,4 --rounds 5

Writes docs/benchmarks/offload.{json,md} after every variant (a cut-off run keeps its rows).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=19, help="double-stream blocks (Flux: 19)")
    p.add_argument("--single-layers", type=int, default=38, help="single-stream blocks (38)")
    p.add_argument("--image-tokens", type=int, default=4096, help="1024x1024 image: 4096")
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--budgets", default="6,12,18",
                   help="shuttle VRAM budgets, GiB, comma-separated")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--accelerate-rounds", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated variant prefixes to run")
    return p.parse_args(argv)


def rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def build_weights(args: argparse.Namespace) -> tuple[Callable[[], torch.nn.Module], int]:
    """A factory of fresh Flux models sharing one random bf16 state dict; and its bytes."""
    from diffusers import FluxTransformer2DModel

    cfg = dict(num_layers=args.layers, num_single_layers=args.single_layers)
    with torch.device("meta"):
        meta = FluxTransformer2DModel(**cfg).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(v.shape, generator=g, dtype=torch.float32) * 0.02).bfloat16()
             if v.is_floating_point() else torch.zeros(v.shape, dtype=v.dtype)
             for k, v in meta.state_dict().items()}

    def factory() -> torch.nn.Module:
        with torch.device("meta"):
            m = FluxTransformer2DModel(**cfg).to(torch.bfloat16)
        m.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
        return m.eval().requires_grad_(False)

    return factory, sum(v.nbytes for v in state.values())


def inputs(args: argparse.Namespace, n: int = 3) -> list[dict]:
    out = []
    for i in range(n):
        g = torch.Generator(device="cuda").manual_seed(i)

        def r(*shape: int, _g: torch.Generator = g) -> torch.Tensor:
            return torch.randn(*shape, generator=_g, device="cuda", dtype=torch.bfloat16)

        out.append(dict(hidden_states=r(1, args.image_tokens, 64),
                        encoder_hidden_states=r(1, args.text_tokens, 4096),
                        pooled_projections=r(1, 768),
                        timestep=torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16),
                        img_ids=torch.zeros(args.image_tokens, 3, device="cuda"),
                        txt_ids=torch.zeros(args.text_tokens, 3, device="cuda"),
                        return_dict=False))
    return out


def measure(name: str, setup: Callable[[], tuple[torch.nn.Module, Callable[[], None], dict]],
            batches: list[dict], rounds: int, warmup: int) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model, teardown, extra = setup()
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    rss = rss_bytes()
    torch.cuda.reset_peak_memory_stats()

    def step(i: int) -> None:
        with torch.no_grad():
            model(**batches[i % len(batches)])

    for i in range(warmup):
        step(i)
    ms = sorted(harness.time_once(step, i) for i in range(rounds))
    row = {"variant": name, "step_ms": ms[len(ms) // 2], "min_ms": ms[0],
           "peak_vram_gib": torch.cuda.max_memory_allocated() / GIB, "setup_s": setup_s,
           "host_rss_gib": rss / GIB, **extra}
    teardown()
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/offload.py needs a CUDA device")
    try:
        factory, weight_bytes = build_weights(args)
    except ImportError:
        sys.exit("benchmarks/offload.py needs diffusers (pip install diffusers) for the Flux model")
    import shuttle

    batches = inputs(args)
    only = [s for s in args.only.split(",") if s]
    rows: list[dict] = []

    def wanted(name: str) -> bool:
        return not only or any(name.startswith(o) for o in only)

    def record(name: str, setup, rounds: int) -> None:
        if not wanted(name):
            return
        rows.append(measure(name, setup, batches, rounds, args.warmup))
        table = harness.markdown_table(
            ["variant", "step ms", "peak VRAM GiB", "pinned GiB", "host RSS GiB", "setup s"],
            [[r["variant"], f"{r['step_ms']:.1f}", f"{r['peak_vram_gib']:.2f}",
              f"{r.get('pinned_gib', float('nan')):.2f}", f"{r['host_rss_gib']:.1f}",
              f"{r['setup_s']:.1f}"] for r in rows])
        harness.write_results("offload", {"args": vars(args), "weight_bytes": weight_bytes,
                                          "rows": rows}, table,
                              "Offloading a Flux-sized DiT (bf16, random weights)",
                              notes=f"Weights: {weight_bytes / GIB:.2f} GiB. One transformer "
                                    "forward per step; median of the rounds.")

    def resident():
        m = factory().cuda()
        return m, lambda: None, {}

    record("resident", resident, args.rounds)

    offloader: list[shuttle.ModelOffloader] = []

    def shuttle_setup(stream):
        def setup():
            t0 = time.perf_counter()
            if not offloader:
                offloader.append(shuttle.ModelOffloader.from_module(
                    factory(), blocks=["transformer_blocks", "single_transformer_blocks"]))
            off = offloader[0]
            capture = time.perf_counter() - t0
            m = off.activate("cuda", stream)
            extra = {"pinned_gib": off.storage.pinned_bytes / GIB, "capture_s": capture,
                     "host_over_weights": off.storage.host_bytes / weight_bytes,
                     "plan": repr(off.plan)}
            return m, off.deactivate, extra
        return setup

    record("shuttle_whole", shuttle_setup(None), args.rounds)
    for b in [float(x) for x in args.budgets.split(",") if x]:
        cfg = shuttle.StreamConfig(prefetch=args.prefetch, vram_budget=int(b * GIB))
        record(f"shuttle_{b:g}GiB", shuttle_setup(cfg), args.rounds)
    offloader.clear()

    def diffusers_group():
        m = factory()
        m.enable_group_offload(onload_device=torch.device("cuda"), offload_type="block_level",
                               num_blocks_per_group=1, use_stream=True, record_stream=True)
        return m, lambda: None, {}

    record("diffusers_group", diffusers_group, args.rounds)

    try:
        import accelerate
    except ImportError:
        accelerate = None
    if accelerate is not None:
        def accelerate_cpu():
            m = factory()
            accelerate.cpu_offload(m, execution_device=torch.device("cuda"))
            return m, lambda: None, {}

        record("accelerate_cpu", accelerate_cpu, args.accelerate_rounds)


if __name__ == "__main__":
    main()
