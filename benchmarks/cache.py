"""Switching models and adapters: shuttle's cache against reloading and pageable copies.

Two models of ``--gb`` GB each (stacks of bf16 8192x8192 linears, random weights) alternate on
the GPU, one interleaved run:

    shuttle_cache      ModelCache.use(spec, "cuda"): the cached model activated from its pinned
                       arenas (whole model), until the copy has landed
    pageable_to_cuda   the same weights held in ordinary (pageable) host memory, ``.to("cuda")``
    reload_file        safetensors.torch.load_file(path, device="cuda") from a page-cached file

Then adapters on one resident model (a rank-64 LoRA on every linear), alternating two adapters:

    dynamic_swap       attach_lora(...) once, then DynamicAdapters.swap(0, other): the factors
                       copied into the attached slots (no rebuild, no recompile)
    scoped_merge       with apply_lora(model, [(lora, 1)], mode="merge"): backup, merge, restore
    factor_copy        the adapter's factors copied from host to device (the target's first term)
    merge              merge_lora of one adapter (the target's second term; undone untimed)

Targets (issue 5): a cached model becomes active at >= 90% of the measured pinned bandwidth; an
adapter switch costs at most the time to copy its factors plus one merge.

    python benchmarks/cache.py            # 10 GB models on the GPU machine
    python benchmarks/cache.py --gb 1     # smaller
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import shuttle  # noqa: E402

SIDE, RANK = 8192, 64
# The GPU machine's device; the CPU runs a smoke test (with SHUTTLE_OFFLOAD_CPU_COPY=1 the
# cache's activation really copies there too).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build(n: int, pool: torch.Tensor, seed: int) -> nn.Module:
    """``n`` bf16 SIDE x SIDE linears whose weights are slices of ``pool`` (random, not zero)."""
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(SIDE, SIDE, bias=False) for _ in range(n)))
    state = {}
    for i in range(n):
        start = (seed * 7919 + i * 1_000_003) % (pool.numel() - SIDE * SIDE)
        state[f"{i}.weight"] = pool[start:start + SIDE * SIDE].view(SIDE, SIDE).clone()
    model.load_state_dict(state, assign=True)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def adapter(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(n):
        sd[f"{i}.lora_A.weight"] = (torch.randn(RANK, SIDE, generator=g) / SIDE**0.5).bfloat16()
        sd[f"{i}.lora_B.weight"] = (torch.randn(SIDE, RANK, generator=g) * 0.02).bfloat16()
    return sd


def pinned_gbs() -> float:
    if DEVICE != "cuda":
        return float("nan")
    host = torch.empty(2 * 2**30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    t = harness.interleaved({"copy": lambda i: dev.copy_(host, non_blocking=True)}, rounds=10)
    return host.numel() / t["copy"]["median_ms"] / 1e6


def wall_ms(fn) -> float:
    """Milliseconds from the call to the device having finished what it queued."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=10.0, help="size of each model (GB)")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    n = max(1, round(args.gb * 1e9 / (SIDE * SIDE * 2)))
    nbytes = n * SIDE * SIDE * 2
    pool = (torch.randn(2 * SIDE * SIDE) * 0.02).bfloat16()
    bw = pinned_gbs()
    print(f"pinned host->device {bw:.1f} GB/s; two models of {nbytes / 1e9:.2f} GB", flush=True)

    cache = shuttle.ModelCache(max_bytes=int(2.2 * nbytes))
    specs = [shuttle.ModelSpec(f"m{s}", factory=lambda s=s: build(n, pool, s)) for s in (1, 2)]
    t0 = time.perf_counter()
    for spec in specs:
        with cache.use(spec, DEVICE):
            pass
    capture_s = time.perf_counter() - t0
    pageable = [build(n, pool, s).state_dict() for s in (1, 2)]
    work = Path(tempfile.mkdtemp(prefix="shuttle-cache-"))
    files = [work / f"m{s}.safetensors" for s in (1, 2)]
    for f, sd in zip(files, pageable, strict=True):
        save_file(sd, str(f))

    def cached(i: int) -> float:
        # From the call until the activation's copies, queued on entry, have landed.
        sync()
        t = time.perf_counter()
        with cache.use(specs[i % 2], DEVICE):
            sync()
            ms = (time.perf_counter() - t) * 1e3
        return ms

    models = {
        "shuttle_cache": cached,
        "pageable_to_cuda": lambda i: wall_ms(
            lambda: [t.to(DEVICE, copy=True) for t in pageable[i % 2].values()]),
        "reload_file": lambda i: wall_ms(lambda: load_file(str(files[i % 2]), device=DEVICE)),
    }
    switch = {k: [] for k in models}
    for r in range(args.rounds + 1):
        for k, fn in models.items():
            ms = fn(r)
            if r:
                switch[k].append(ms)
        print({k: round(v[-1], 1) for k, v in switch.items() if v}, flush=True)
    for f in files:
        f.unlink()

    # Adapters on one resident model.
    model = build(n, pool, 1).to(DEVICE)
    loras = [shuttle.load_lora(adapter(n, s)) for s in (3, 4)]
    factor_bytes = sum(t.nbytes for t in adapter(n, 3).values())
    host_factors = [adapter(n, s) for s in (3, 4)]
    backup = [p.detach().clone() for p in model.parameters()]
    handle = shuttle.attach_lora(model, [(loras[0], 1.0)])

    def restore(name: str, i: int) -> None:
        if name == "merge":
            with torch.no_grad():
                for p, b in zip(model.parameters(), backup, strict=True):
                    p.copy_(b)

    adapters = {
        "dynamic_swap": lambda i: handle.swap(0, loras[(i + 1) % 2]),
        "factor_copy": lambda i: [t.to(DEVICE, copy=True)
                                  for t in host_factors[i % 2].values()],
    }
    timings = harness.interleaved(adapters, rounds=args.rounds, warmup=1)
    handle.detach()
    more = {
        "scoped_merge": lambda i: _scoped(model, loras[i % 2]),
        "merge": lambda i: shuttle.merge_lora(model, [(loras[i % 2], 1.0)], progress=False),
    }
    timings.update(harness.interleaved(more, rounds=args.rounds, warmup=1, between=restore))

    med = {k: sorted(v)[len(v) // 2] for k, v in switch.items()}
    rows = [[k, f"{med[k]:.1f}", f"{nbytes / med[k] / 1e6:.1f}",
             f"{100 * nbytes / med[k] / 1e6 / bw:.0f}%", f"{med[k] / med['shuttle_cache']:.2f}"]
            for k in models]
    table = harness.markdown_table(
        ["model switch", "ms", "GB/s", "of pinned bandwidth", "vs shuttle"], rows)
    budget = timings["factor_copy"]["median_ms"] + timings["merge"]["median_ms"]
    rows2 = [[k, f"{v['median_ms']:.2f}", f"{v['median_ms'] / budget:.2f}"]
             for k, v in timings.items()]
    table += "\n\n" + harness.markdown_table(
        ["adapter switch (one resident model)", "ms", "vs factor copy + one merge"], rows2)
    notes = (f"Two models of {n} bf16 {SIDE}x{SIDE} linears ({nbytes / 1e9:.2f} GB each) "
             f"alternating; pinned host->device bandwidth {bw:.1f} GB/s measured in the same "
             f"run; first capture and pinning of both models {capture_s:.1f} s. Adapters: rank "
             f"{RANK} on every linear ({factor_bytes / 1e6:.0f} MB of factors). Medians of "
             f"{args.rounds} rounds.")
    harness.write_results("cache", {"model_switch_ms": switch, "adapter_ms": timings,
                                    "pinned_gbs": bw, "weight_bytes": nbytes,
                                    "capture_s": capture_s}, table,
                          "Switching models and adapters (benchmarks/cache.py)", notes)
    print(table)
    print(notes)


def _scoped(model: nn.Module, lora) -> None:
    with shuttle.apply_lora(model, [(lora, 1.0)], mode="merge"):
        pass


if __name__ == "__main__":
    main()
