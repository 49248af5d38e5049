"""Offloading DiTs: shuttle's block streaming against diffusers group offloading and accelerate.

Models (--model flux | wan | both), random bf16 weights (slices of one random pool at varying
offsets: no zeros, no NaN) shared by every variant of a model:

    flux    diffusers' FluxTransformer2DModel at its default config (19 double + 38 single
            blocks, 23.8 GB), 1024x1024: 4096 image + 512 text tokens. Transfer-bound when
            most of it streams.
    wan     WanTransformer3DModel at the Wan2.1 1.3B config (30 blocks, 2.8 GB), a 21x60x104
            latent (81 frames at 480x832): 32760 tokens + 512 text tokens. Compute-bound.

Variants per model (--only keeps those starting with the given prefixes; the resident reference
always runs):

    resident                  model.to("cuda"): the reference, kept on the GPU for the section
    shuttle_whole             ModelOffloader.activate("cuda"): every unit copied from its arena
    shuttle_min               StreamConfig(prefetch): nothing resident, every block streamed
    shuttle_<f>x              StreamConfig(prefetch, vram_budget=f * weight bytes), --fractions
    shuttle_<B>GiB            StreamConfig(prefetch, vram_budget=B GiB), --budgets
    shuttle_min_lora_dynamic  shuttle_min with a rank-32 (--lora-rank) LoRA on every Linear of
                              the blocks, added at forward time (mode="dynamic")
    diffusers_group           enable_group_offload(block_level, 1 block per group,
                              use_stream=True, record_stream=True)
    accelerate_cpu            accelerate.cpu_offload (flux only unless --wan-accelerate; few
                              rounds)

One ModelOffloader (one capture) serves every shuttle variant; it is dropped before the diffusers
variant, so that at most two host copies of the weights are alive at once: the benchmark's own
(shared by every model it builds, never cloned) and the variant's.

Timing: after its warm-up steps, each variant's steps alternate with the resident reference's in
chunks of --chunk back-to-back steps (an event after each step, no host sync inside a chunk, as
in a sampling loop); the first step of each chunk absorbs the switch and is dropped. Medians are
reported; "vs resident" uses the resident steps of the same chunks. Bound: max(resident step,
bytes streamed per step / pinned bandwidth), the bandwidth measured once (a pinned 2 GiB
host->device copy). Host syncs per step: CUDA runtime synchronize calls and blocking cudaMemcpy
in one profiled steady-state step.

    PYTHONPATH=src python benchmarks/offload.py --model both      # the H200 run
    PYTHONPATH=src python benchmarks/offload.py --storage bf16,fp8 --out offload_fp8  # issue 6

--storage fp8 stores the blocks' Linear weights as float8 e4m3 (half the bytes; the model
computes through shuttle.upcast_on_use, diffusers_group through diffusers'
enable_layerwise_casting) and reports the section as <model>_fp8. --storage lossless captures
shuttle's offloader with compress="lossless" (the same bf16 weights, coded in host memory and
decoded on the GPU on a stream of their own; about 0.7x the bytes over the bus; issue 40); its
rows add copied_bytes, and the bound stays the bf16 copy bound. --storage lossless_serial is the
same with the decodes on the copy stream after each copy (SHUTTLE_DECODE_STREAM=0 for that
section), so one run compares the two.
    PYTHONPATH=src python benchmarks/offload.py --layers 4 --single-layers 8 --fractions 0.75

Writes docs/benchmarks/<--out, default offload>.{json,md} (under $SHUTTLE_BENCH_OUT when set)
after every variant, so a cut-off run keeps its rows.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

GIB = 2**30
GB = 1e9
DEVICE = torch.device("cuda")
POOL = 2**26  # random bf16 values that every weight is sliced from
FLUX_CONFIG: dict = {}  # diffusers' defaults; layer counts come from the command line
# Wan2.1 T2V 1.3B (diffusers' defaults are the 14B model); num_layers from --wan-layers.
WAN_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                  in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                  cross_attn_norm=True, eps=1e-6)
BLOCKS = {"flux": ["transformer_blocks", "single_transformer_blocks"], "wan": ["blocks"]}
ROUNDS = {"flux": 10, "wan": 4}  # defaults of --rounds and --warmup per model
WARMUP = {"flux": 2, "wan": 1}
STEP_MARK = "offload_benchmark_step"  # the record_function range of the profiled step

Step = Callable[[int], None]
Setup = Callable[[], tuple[nn.Module, Callable[[], None], dict]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["flux", "wan", "both"], default="flux")
    p.add_argument("--layers", type=int, default=19, help="Flux double-stream blocks (19)")
    p.add_argument("--single-layers", type=int, default=38, help="Flux single-stream blocks (38)")
    p.add_argument("--image-tokens", type=int, default=4096, help="Flux; 1024x1024: 4096")
    p.add_argument("--text-tokens", type=int, default=512, help="text tokens (both models)")
    p.add_argument("--wan-layers", type=int, default=30, help="Wan blocks (1.3B: 30)")
    p.add_argument("--wan-latent", default="21x60x104",
                   help="Wan latent frames x height x width (81 frames at 480x832: 21x60x104)")
    p.add_argument("--fractions", default="0.25,0.5",
                   help="shuttle VRAM budgets as fractions of the weight bytes, comma-separated")
    p.add_argument("--budgets", default="", help="more shuttle VRAM budgets, GiB, comma-separated")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--rounds", type=int, help="timed steps per variant (flux 10, wan 4)")
    p.add_argument("--warmup", type=int, help="warm-up steps per variant (flux 2, wan 1; >= 1)")
    p.add_argument("--chunk", type=int, default=2,
                   help="timed steps per alternation with the resident reference")
    p.add_argument("--accelerate-rounds", type=int, default=2, help="(warm-up: 1 step)")
    p.add_argument("--wan-accelerate", action="store_true", help="also run accelerate on wan")
    p.add_argument("--only", default="", help="comma-separated variant prefixes to run")
    p.add_argument("--storage", default="bf16",
                   help="comma-separated block Linear weight storage: bf16, fp8 (float8 e4m3, "
                        "computed through shuttle.upcast_on_use), lossless (bf16 kept coded "
                        "in host memory, compress='lossless'), lossless_serial (the same, "
                        "decoded on the copy stream); sections are named "
                        "<model>_<storage>")
    p.add_argument("--decode-kernel", default="",
                   help="lossless storage: the GPU decoder (a name of shuttle.kernels."
                        "exponent_decode.DECODE_KERNELS; default: its DEFAULT_KERNEL)")
    p.add_argument("--out", default="offload", help="results name under docs/benchmarks/")
    return p.parse_args(argv)


def floats(csv: str) -> list[float]:
    return [float(x) for x in csv.split(",") if x.strip()]


def rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def pinned_cache_bytes() -> int | None:
    """Bytes held by PyTorch's pinned host allocator (``pin_memory()``); None if unreported."""
    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return None
    # Held bytes (in use and cached): "reserved_bytes" in releases that report it, where
    # "allocated_bytes" is the in-use part; "allocated_bytes" in later ones.
    held = stats.get("reserved_bytes.current", stats.get("allocated_bytes.current"))
    return None if held is None else int(held)


def release_pinned_cache() -> None:
    """Return the pinned host allocator's cached blocks to the system (freed pin_memory())."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def copy_ms(nbytes: int, reps: int) -> float:
    """Median ms of a host->device copy of ``nbytes`` from pinned memory, after one warm-up."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)

    def copy(_: int) -> None:
        dev.copy_(host, non_blocking=True)

    copy(0)
    return statistics.median(harness.time_once(copy, i) for i in range(reps))


def pinned_bandwidth(nbytes: int = 2 * GIB, reps: int = 10) -> float:
    """Host->device GB/s of one pinned ``nbytes`` copy (median of ``reps``): the copy ceiling."""
    ms = copy_ms(nbytes, reps)
    torch.cuda.synchronize()
    release_pinned_cache()  # the 2 GiB buffer, so it counts in no variant's host memory
    torch.cuda.empty_cache()
    return nbytes / GB / (ms / 1e3)


def fill(t: torch.Tensor, pool: torch.Tensor, offset: int) -> torch.Tensor:
    """Fill ``t`` from ``pool`` starting at ``offset``, wrapping around (no randn per tensor)."""
    flat, n = t.view(-1), pool.numel()
    done = 0
    while done < flat.numel():
        start = (offset + done) % n
        k = min(flat.numel() - done, n - start)
        flat[done:done + k].copy_(pool[start:start + k])
        done += k
    return t


def build_weights(cls: type, cfg: dict, pool: torch.Tensor, blocks: list[str],
                  storage: str = "bf16") -> tuple[Callable[..., nn.Module], nn.Module, int]:
    """A factory of models sharing one random bf16 state dict; a weightless skeleton; the bytes.

    With ``storage="fp8"`` the weights of the blocks' Linear layers are stored as float8 e4m3
    (what fp8 checkpoints hold) and ``factory()`` returns the model with
    ``shuttle.upcast_on_use`` installed (``factory(upcast=False)``: without).

    Models are built under ``init_empty_weights`` (parameters on meta, buffers real: Wan's
    rotary tables are non-persistent buffers, absent from the state dict) and take the state's
    tensors by assignment: every variant starts from the same host copy without cloning it.
    None of the variants writes weights in place.
    """
    from accelerate import init_empty_weights

    def skeleton() -> nn.Module:
        with init_empty_weights():
            return cls(**cfg)

    import shuttle

    meta = skeleton()
    fp8 = {f"{n}.weight" for n, m in meta.named_modules() if storage == "fp8"
           and isinstance(m, nn.Linear) and any(n.startswith(f"{b}.") for b in blocks)}
    state = {}
    for i, (k, v) in enumerate(meta.state_dict().items()):
        if v.is_floating_point():
            state[k] = fill(torch.empty(v.shape, dtype=torch.bfloat16), pool, i * 1_000_003)
            if k in fp8:
                state[k] = state[k].to(torch.float8_e4m3fn)
        else:
            state[k] = torch.zeros(v.shape, dtype=v.dtype)

    def factory(upcast: bool = True) -> nn.Module:
        m = skeleton()
        # detach(): fresh tensor objects on the shared storage, so that re-pointing one model's
        # tensors (.data =) never re-points the state's.
        m.load_state_dict({k: v.detach() for k, v in state.items()}, assign=True)
        if fp8 and upcast:
            shuttle.upcast_on_use(m)  # the hooks live with the model (dropped with it)
        return m.eval().requires_grad_(False)

    return factory, meta, sum(v.nbytes for v in state.values())


def lora_state(model: nn.Module, blocks: list[str], rank: int, pool: torch.Tensor
               ) -> dict[str, torch.Tensor]:
    """A PEFT-style bf16 LoRA of ``rank`` on every nn.Linear inside the block lists."""
    sd, offset = {}, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and any(name.startswith(f"{b}.") for b in blocks):
            for key, shape in (("lora_A", (rank, mod.in_features)),
                               ("lora_B", (mod.out_features, rank))):
                sd[f"{name}.{key}.weight"] = fill(torch.empty(shape, dtype=torch.bfloat16),
                                                  pool, offset)
                offset += 7_919_993
    return sd


def make_inputs(name: str, cfg, args: argparse.Namespace, n: int = 3) -> tuple[list[dict], int]:
    """``n`` input sets on the device (rotated through by the steps); and the token count."""
    f, h, w = (int(x) for x in args.wan_latent.split("x"))
    out = []
    for i in range(n):
        g = torch.Generator(device=DEVICE).manual_seed(i)

        def r(*shape: int, _g: torch.Generator = g) -> torch.Tensor:
            return torch.randn(*shape, generator=_g, device=DEVICE, dtype=torch.bfloat16)

        if name == "flux":
            out.append(dict(hidden_states=r(1, args.image_tokens, cfg.in_channels),
                            encoder_hidden_states=r(1, args.text_tokens, cfg.joint_attention_dim),
                            pooled_projections=r(1, cfg.pooled_projection_dim),
                            timestep=torch.full((1,), 0.25 * (i + 1), device=DEVICE,
                                                dtype=torch.bfloat16),
                            img_ids=torch.zeros(args.image_tokens, 3, device=DEVICE),
                            txt_ids=torch.zeros(args.text_tokens, 3, device=DEVICE),
                            return_dict=False))
        else:
            out.append(dict(hidden_states=r(1, cfg.in_channels, f, h, w),
                            timestep=torch.full((1,), 250.0 * (i + 1), device=DEVICE),
                            encoder_hidden_states=r(1, args.text_tokens, cfg.text_dim),
                            return_dict=False))
    if name == "flux":
        return out, args.image_tokens + args.text_tokens
    pt, ph, pw = cfg.patch_size
    return out, f // pt * (h // ph) * (w // pw) + args.text_tokens


def make_step(model: nn.Module, batches: list[dict]) -> Step:
    def step(i: int) -> None:
        with torch.no_grad():
            model(**batches[i % len(batches)])
    return step


def chunk_ms(step: Step, start: int, n: int) -> list[float]:
    """Per-step ms of ``n`` back-to-back steps after one dropped step; one host sync, at the end."""
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    for k, end in enumerate(ends):
        step(start + k)
        end.record()
    ends[-1].synchronize()
    return [a.elapsed_time(b) for a, b in itertools.pairwise(ends)]


def timed(step: Step, reference: Step | None, rounds: int, chunk: int
          ) -> tuple[list[float], list[float]]:
    """``rounds`` step times of ``step`` and as many of ``reference``, alternating by chunks."""
    ms: list[float] = []
    ref_ms: list[float] = []
    i = 0
    while len(ms) < rounds:
        n = min(max(chunk, 1), rounds - len(ms))
        if reference is not None:
            ref_ms += chunk_ms(reference, i, n)
        ms += chunk_ms(step, i, n)  # last, so that a profiled step right after is steady-state
        i += n + 1
    return ms, ref_ms


def is_sync(name: str) -> bool:
    """A CUDA runtime call that blocks the host until the device catches up."""
    return "Synchronize" in name or (name.startswith("cudaMemcpy") and "Async" not in name)


def count_syncs(events: Iterable) -> int | None:
    """Blocking runtime calls inside the CPU range named ``STEP_MARK`` (None if it is missing)."""
    events = list(events)
    marks = [e for e in events
             if e.name == STEP_MARK and e.device_type == torch.autograd.DeviceType.CPU]
    if not marks:
        return None
    lo, hi = marks[0].time_range.start, marks[0].time_range.end
    return sum(1 for e in events
               if is_sync(e.name) and lo <= e.time_range.start and e.time_range.end <= hi)


def host_syncs(step: Step) -> int | None:
    """Host syncs in one profiled step; None if the profiler fails.

    Counted inside the step's ``record_function`` range only: the profiler's own synchronize
    when it stops lies outside it.
    """
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    try:
        with (torch.profiler.profile(activities=acts) as prof,
              torch.profiler.record_function(STEP_MARK)):
            step(0)
        return count_syncs(prof.events())
    except Exception as e:  # a profiler failure costs this column only
        print(f"  profiler failed: {type(e).__name__}: {e}", flush=True)
        return None
    finally:
        torch.cuda.synchronize()


def measure(setup: Setup, batches: list[dict], reference: Step | None, rounds: int,
            warmup: int, chunk: int) -> dict:
    """Set one variant up, warm it up (peak VRAM), time it against ``reference``, profile one
    step, tear it down; returns its row.

    ``setup()`` returns (model, teardown, extra row fields). Peak VRAM counts what the variant
    allocates during setup and warm-up above what was allocated before (the inputs and the
    resident reference).
    """
    gc.collect()
    release_pinned_cache()  # pin_memory() blocks of a dropped variant
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base, pinned0 = torch.cuda.memory_allocated(), pinned_cache_bytes()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model, teardown, row = setup()
    torch.cuda.synchronize()
    row["setup_s"] = time.perf_counter() - t0
    try:
        row["host_rss"] = rss_bytes()
        pinned1 = pinned_cache_bytes()
        row.setdefault("pinned_bytes", None if pinned0 is None or pinned1 is None
                       else pinned1 - pinned0)
        step = make_step(model, batches)
        for i in range(max(warmup, 1)):
            step(i)
        torch.cuda.synchronize()
        row["peak_vram_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
        ms, ref_ms = timed(step, reference, rounds, chunk)
        row["syncs_per_step"] = host_syncs(step)
    finally:
        teardown()
    row.update(step_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms), rounds=len(ms),
               resident_ms=statistics.median(ref_ms) if ref_ms else None)
    return row


def derive(row: dict, pinned_gbs: float) -> None:
    """Add ratios, bound and copy throughput to a timed row (in place)."""
    if "step_ms" not in row:
        return
    step, ref, streamed = row["step_ms"], row["resident_ms"], row.get("streamed_bytes", 0)
    row["transfer_ms"] = streamed / (pinned_gbs * GB) * 1e3
    row["copy_gbs"] = streamed / GB / (step / 1e3) if streamed else None
    row["copy_of_pinned"] = row["copy_gbs"] / pinned_gbs if streamed else None
    pinned = row["pinned_bytes"]
    row["pinned_over_weights"] = None if pinned is None else pinned / row["weight_bytes"]
    if ref:
        row["vs_resident"] = step / ref
        row["bound_ms"] = max(ref, row["transfer_ms"])
        row["step_over_bound"] = step / row["bound_ms"]


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


HEADERS = ["model", "variant", "step ms", "vs resident", "bound ms", "step/bound",
           "copy GB/s (% of pinned)", "peak VRAM GiB", "pinned GiB", "pinned/weights",
           "host RSS +GiB", "setup s (capture / activate)", "syncs/step"]


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["model"], r["variant"], f"error: {r['error'][:120]}"]
                       + [""] * (len(HEADERS) - 3))
            continue
        copy = (f"{r['copy_gbs']:.1f} ({100 * r['copy_of_pinned']:.0f}%)"
                if r["copy_gbs"] is not None else "-")
        setup = (f"{r['capture_s']:.1f} / {r['activate_s']:.2f}" if "capture_s" in r
                 else f"{r['setup_s']:.1f}")
        out.append([r["model"], r["variant"], f"{r['step_ms']:.1f}",
                    fmt(r.get("vs_resident"), ".3f"), fmt(r.get("bound_ms"), ".1f"),
                    fmt(r.get("step_over_bound"), ".3f"), copy, f"{r['peak_vram_gib']:.2f}",
                    fmt(None if r["pinned_bytes"] is None else r["pinned_bytes"] / GIB, ".2f"),
                    fmt(r["pinned_over_weights"], ".3f"),
                    f"{r['host_rss_gib']:.1f}", setup, fmt(r["syncs_per_step"], "d")])
    return harness.markdown_table(HEADERS, out)


class Report:
    """Rows of every model section, written out after each one."""

    def __init__(self, args: argparse.Namespace, pinned_gbs: float):
        self.args = args
        self.pinned_gbs = pinned_gbs
        self.models: dict[str, dict] = {}
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        derive(row, self.pinned_gbs)
        self.rows.append(row)
        if "error" in row:
            print(f"[{row['model']}] {row['variant']}: error: {row['error']}", flush=True)
        else:
            keys = ("step_ms", "resident_ms", "vs_resident", "step_over_bound", "copy_gbs",
                    "peak_vram_gib", "pinned_bytes", "setup_s", "syncs_per_step")
            print(f"[{row['model']}] {row['variant']}: "
                  + ", ".join(f"{k}={row.get(k)!r}" for k in keys), flush=True)
        self.write()

    def notes(self) -> str:
        from shuttle.kernels import exponent_decode

        lines = [f"Pinned host->device bandwidth: {self.pinned_gbs:.1f} GB/s (one 2 GiB copy, "
                 "median of 10)."]
        if "lossless" in self.args.storage:
            lines.append(f"Lossless storage decoded by the {exponent_decode.DEFAULT_KERNEL!r} "
                         "kernel.")
        for name, m in self.models.items():
            lines.append(f"{name}: {m['class']}({m['config']}), weights "
                         f"{m['weight_bytes'] / GB:.2f} GB, {m['tokens']} tokens; {m['rounds']} "
                         f"timed steps per variant (warm-up {m['warmup']}).")
            by = {r["variant"]: r for r in self.rows if r["model"] == name and "vs_resident" in r}
            if "shuttle_min" in by and "shuttle_min_lora_dynamic" in by:
                extra = by["shuttle_min_lora_dynamic"]["vs_resident"] / by["shuttle_min"][
                    "vs_resident"] - 1
                lines.append(f"{name}: dynamic LoRA (rank {self.args.lora_rank}) while streaming "
                             f"adds {100 * extra:+.1f}% over shuttle_min.")
            base = name.rsplit("_fp8", 1)[0]
            bf16 = {r["variant"]: r for r in self.rows if r["model"] == base
                    and "step_ms" in r}
            if name != base and "shuttle_min" in by and "shuttle_min" in bf16:
                f8, b16 = by["shuttle_min"], bf16["shuttle_min"]
                lines.append(
                    f"{name}: streaming every block in fp8 moves "
                    f"{f8['streamed_bytes'] / b16['streamed_bytes']:.3f}x the bytes of bf16 and "
                    f"takes {f8['step_ms'] / b16['step_ms']:.3f}x its step time "
                    f"({f8['step_ms']:.1f} vs {b16['step_ms']:.1f} ms); step / own bound "
                    f"{f8['step_over_bound']:.3f}.")
        lines += [
            "",
            "One transformer forward per step, random bf16 weights (fp8 sections: the blocks'"
            " Linear weights stored as float8 e4m3 and cast to bf16 per layer as it runs). "
            "Steps alternate with the resident model's in chunks (back to back, no host sync "
            "inside a chunk, first step of each chunk dropped); medians. vs resident: over "
            "the resident steps of the same chunks. bound: max(resident step, bytes streamed "
            "per step / pinned bandwidth); shuttle streams the non-resident blocks, diffusers"
            " and accelerate every weight. copy GB/s: bytes streamed per step / step time. "
            "Peak VRAM: allocated during setup and warm-up above what was allocated before "
            "(inputs, resident reference). Pinned: shuttle's registered arenas; otherwise "
            "growth of PyTorch's pinned host allocator. host RSS +GiB: process RSS after "
            "setup over the RSS before the section's first variant (which holds the "
            "benchmark's one copy of the weights). setup: shuttle's capture and pinning (once"
            " per model) / activate; otherwise the whole setup. syncs/step: cuda*Synchronize "
            "and blocking cudaMemcpy calls in one profiled steady-state step.",
        ]
        return "\n".join(lines)

    def write(self) -> None:
        payload = {"args": vars(self.args), "pinned_gbs": self.pinned_gbs,
                   "models": self.models, "rows": self.rows}
        harness.write_results(self.args.out, payload, table(self.rows),
                              "Offloading DiTs: shuttle vs diffusers group offloading and "
                              "accelerate", notes=self.notes())


def run_model(name: str, args: argparse.Namespace, report: Report, storage: str = "bf16"
              ) -> None:
    """Every variant of one model, each row reported as it is measured; ``storage``: the
    blocks' Linear weights in bf16 or fp8 (section ``<name>_fp8``)."""
    import accelerate
    import diffusers

    import shuttle

    if name == "flux":
        cls = diffusers.FluxTransformer2DModel
        cfg = dict(FLUX_CONFIG, num_layers=args.layers, num_single_layers=args.single_layers)
    else:
        cls = diffusers.WanTransformer3DModel
        cfg = dict(WAN_CONFIG, num_layers=args.wan_layers)
    blocks = BLOCKS[name]
    rounds = args.rounds if args.rounds is not None else ROUNDS[name]
    warmup = args.warmup if args.warmup is not None else WARMUP[name]
    only = [s for s in args.only.split(",") if s]

    t0 = time.perf_counter()
    pool = (torch.randn(POOL, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    factory, meta, weight_bytes = build_weights(cls, cfg, pool, blocks, storage)
    label = name if storage == "bf16" else f"{name}_{storage}"
    lora = shuttle.load_lora(lora_state(meta, blocks, args.lora_rank, pool))
    del pool
    batches, tokens = make_inputs(name, meta.config, args)
    print(f"[{name}] {weight_bytes / GB:.2f} GB of weights built in "
          f"{time.perf_counter() - t0:.1f} s, {tokens} tokens", flush=True)
    report.models[label] = {"storage": storage, "class": cls.__name__, "config": cfg,
                           "weight_bytes": weight_bytes, "tokens": tokens, "rounds": rounds,
                           "warmup": warmup}
    base_rss = rss_bytes()
    reference: list[Step] = []

    def record(variant: str, setup: Setup, n: int = rounds, w: int = warmup) -> None:
        if variant != "resident" and only and not any(variant.startswith(o) for o in only):
            return
        print(f"[{name}] {variant} ...", flush=True)
        t = time.perf_counter()
        try:
            row = measure(setup, batches, reference[0] if reference else None, n, w,
                          args.chunk)
            row["host_rss_gib"] = (row["host_rss"] - base_rss) / GIB
            if variant == "resident":
                row["resident_ms"] = row["step_ms"]
        except Exception as e:  # one failing variant must not cost the others their rows
            traceback.print_exc()
            row = {"error": f"{type(e).__name__}: {e}"}
        row["wall_s"] = time.perf_counter() - t
        report.add({"model": label, "variant": variant, "weight_bytes": weight_bytes, **row})

    def resident() -> tuple[nn.Module, Callable[[], None], dict]:
        m = factory().to(DEVICE)
        reference.append(make_step(m, batches))  # kept (and on the GPU) for the section
        return m, lambda: None, {}

    record("resident", resident)
    if "error" in report.rows[-1]:
        reference.clear()  # the other variants are timed alone

    offloader: list[shuttle.ModelOffloader] = []  # captured by the first shuttle variant
    capture_s: list[float] = []

    def shuttle_setup(stream: shuttle.StreamConfig | None, loras: tuple = ()) -> Setup:
        def setup() -> tuple[nn.Module, Callable[[], None], dict]:
            if not offloader:
                model = factory()
                t = time.perf_counter()
                offloader.append(shuttle.ModelOffloader.from_module(
                    model, blocks=blocks,
                    compress="lossless" if storage.startswith("lossless") else None))
                capture_s.append(time.perf_counter() - t)
            off = offloader[0]
            t = time.perf_counter()
            m = off.activate(DEVICE, stream, loras=loras, mode="dynamic")
            torch.cuda.synchronize()
            activate_s = time.perf_counter() - t
            plan = off.plan
            streamed = sum(u.layout.nbytes for g, units in off.storage.groups.items()
                           for i, u in enumerate(units) if i not in plan.resident[g])
            # bytes over the bus per step (the code, for lossless storage)
            copied = sum(u.code.nbytes if u.code is not None else u.layout.nbytes
                         for g, units in off.storage.groups.items()
                         for i, u in enumerate(units) if i not in plan.resident[g])
            extra = {"capture_s": capture_s[0], "activate_s": activate_s,
                     "pinned_bytes": off.storage.pinned_bytes,
                     "host_bytes": off.storage.host_bytes, "streamed_bytes": streamed,
                     "copied_bytes": copied,
                     "plan": {"resident": {g: len(p) for g, p in plan.resident.items()},
                              "ring": plan.ring, "prefetch": plan.prefetch,
                              "device_gib": plan.device_bytes / GIB}}
            if off.adapters is not None:
                extra["lora_applied"] = len(off.adapters.report.applied)
            return m, off.deactivate, extra
        return setup

    p = args.prefetch
    record("shuttle_whole", shuttle_setup(None))
    record("shuttle_min", shuttle_setup(shuttle.StreamConfig(prefetch=p)))
    for f in floats(args.fractions):
        record(f"shuttle_{f:g}x", shuttle_setup(
            shuttle.StreamConfig(prefetch=p, vram_budget=int(f * weight_bytes))))
    for b in floats(args.budgets):
        record(f"shuttle_{b:g}GiB", shuttle_setup(
            shuttle.StreamConfig(prefetch=p, vram_budget=int(b * GIB))))
    record("shuttle_min_lora_dynamic",
           shuttle_setup(shuttle.StreamConfig(prefetch=p), loras=((lora, 1.0),)))
    offloader.clear()  # its pinned arenas are unregistered and freed with it

    def diffusers_group() -> tuple[nn.Module, Callable[[], None], dict]:
        m = factory(upcast=False)
        if storage == "fp8":  # diffusers' own way to compute with float8 storage, over the
            # same weights as shuttle's: the blocks' Linear layers (not their norms)
            # (the function, not the model method, which would also keep Flux's adaLN
            # modulation layers, "norm*.linear", in bf16)
            from diffusers.hooks import apply_layerwise_casting
            from diffusers.models.normalization import RMSNorm

            outside = "^(" + "|".join(n for n, _ in m.named_children() if n not in blocks) + ")"
            apply_layerwise_casting(m, torch.float8_e4m3fn, torch.bfloat16,
                                    skip_modules_pattern=(outside,),
                                    skip_modules_classes=(RMSNorm, nn.LayerNorm))
        m.enable_group_offload(onload_device=DEVICE, offload_type="block_level",
                               num_blocks_per_group=1, use_stream=True, record_stream=True)
        return m, lambda: None, {"streamed_bytes": weight_bytes}

    if not storage.startswith("lossless"):  # the peers have no lossless storage: bf16's stand
        record("diffusers_group", diffusers_group)

    def accelerate_cpu() -> tuple[nn.Module, Callable[[], None], dict]:
        m = factory()
        accelerate.cpu_offload(m, execution_device=DEVICE)
        return m, lambda: None, {"streamed_bytes": weight_bytes}

    if storage == "bf16" and (name == "flux" or args.wan_accelerate):
        record("accelerate_cpu", accelerate_cpu, args.accelerate_rounds, 1)


@contextlib.contextmanager
def decode_stream(on: bool) -> Iterator[None]:
    """Coded loads decode on their own stream (``on``) or on the copy stream, for a section."""
    from shuttle.offload.coded import DECODE_STREAM_ENV

    saved = os.environ.get(DECODE_STREAM_ENV)
    os.environ[DECODE_STREAM_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(DECODE_STREAM_ENV, None)
        else:
            os.environ[DECODE_STREAM_ENV] = saved


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/offload.py needs a CUDA device")
    try:
        import accelerate  # noqa: F401
        import diffusers  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/offload.py needs diffusers and accelerate "
                 "(pip install diffusers accelerate)")
    if args.decode_kernel:
        from shuttle.kernels import exponent_decode

        if args.decode_kernel not in exponent_decode.DECODE_KERNELS:
            sys.exit(f"--decode-kernel: one of {sorted(exponent_decode.DECODE_KERNELS)}")
        exponent_decode.DEFAULT_KERNEL = args.decode_kernel  # read at every decode
    pinned_gbs = pinned_bandwidth()
    print(f"pinned host->device: {pinned_gbs:.1f} GB/s", flush=True)
    report = Report(args, pinned_gbs)
    for name in (["flux", "wan"] if args.model == "both" else [args.model]):
        for storage in args.storage.split(","):
            with decode_stream(storage != "lossless_serial"):
                run_model(name, args, report, storage)
            gc.collect()
            release_pinned_cache()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
