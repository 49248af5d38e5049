"""Shared benchmark timing and reporting.

Timing: CUDA events around each call, after warm-up; variants run interleaved, each round in
its own seeded order (A B C, C A B, B C A, ...), so that clock and power drift and whatever one
call leaves for the next hit every variant alike; the median of the rounds is reported.
Callables receive the round index so they can rotate through several input sets (never timing
the same cached buffer, never zeros).

Results: ``docs/benchmarks/<name>.json`` (every number, plus device, torch version, commit and
date) and ``docs/benchmarks/<name>.md`` (a table).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import random
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = Path(os.environ.get("SHUTTLE_BENCH_OUT", ROOT / "docs" / "benchmarks"))


def environment() -> dict[str, str]:
    """Device, versions, commit and date for the record."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "device": dev,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "commit": os.environ.get("SHUTTLE_COMMIT", commit) or "unknown",
        "date": _dt.date.today().isoformat(),
    }


def time_once(fn: Callable[[int], object], i: int) -> float:
    """Milliseconds of one call of ``fn(i)``, by CUDA events (host clock on CPU)."""
    if torch.cuda.is_available():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    import time

    t0 = time.perf_counter()
    fn(i)
    return (time.perf_counter() - t0) * 1e3


def spin_up(seconds: float = 1.0) -> None:
    """Keep the GPU busy for ``seconds`` (bf16 GEMMs) so its clocks leave their idle state
    before short, sync-heavy work is timed (an idle H200 reads 345 MHz)."""
    if not torch.cuda.is_available():
        return
    import time

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


_PROFILER_OVERHEAD = ("Activity Buffer",)


def gpu_ms(fn: Callable[[int], object], n: int = 5) -> float:
    """Milliseconds of GPU kernel time per call of ``fn`` (profiled; host time excluded)."""
    from torch.profiler import ProfilerActivity, profile

    fn(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            fn(i)
        torch.cuda.synchronize()
    # CUPTI's own bookkeeping ("Activity Buffer Request", once per session, tens to a hundred
    # microseconds) is reported with device time too: not the step's work
    total_us = sum(e.self_device_time_total for e in prof.key_averages()
                   if not e.key.startswith(_PROFILER_OVERHEAD))
    return total_us / 1e3 / n


def host_ms(fn: Callable[[int], object], n: int = 20) -> float:
    """Milliseconds of host time per call of ``fn``: issuing its work (median of ``n``; the
    device drained before each call, so a host sync inside ``fn`` costs only its round trip)."""
    out = []
    for i in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def interleaved(variants: dict[str, Callable[[int], object]], rounds: int = 20,
                warmup: int = 3, between: Callable[[str, int], object] | None = None,
                timer: Callable[[str, Callable[[int], object], int], float] | None = None
                ) -> dict[str, dict[str, float]]:
    """Time each variant ``rounds`` times, interleaved; return median/min/max ms per variant.

    ``between(name, i)``, if given, runs untimed after each call (e.g. to undo a merge).
    ``timer(name, fn, i)``, if given, times one call in ms instead of :func:`time_once` (the
    distributed benchmark's, which runs a variant on one rank or on all).
    """
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(warmup + rounds):
        # Each round in its own order (seeded by the round): what one call leaves for the
        # next (TLB and cache state, garbage for the collector) falls on every variant alike.
        # In a fixed order, even rotated, each variant always follows the same one: the merge
        # benchmark's first variant, after a 4.8 GB copy, took 0.2-0.5 ms more than the same
        # work in the next slot.
        names = list(variants)
        random.Random(r).shuffle(names)
        for name in names:
            fn = variants[name]
            ms = time_once(fn, r) if timer is None else timer(name, fn, r)
            if between is not None:
                between(name, r)
            if r >= warmup:
                samples[name].append(ms)
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v),
                "rounds": len(v)} for k, v in samples.items()}


def graphed(fn: Callable[[], object], warmup: int = 3) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph after ``warmup`` calls on a side stream (as PyTorch
    documents: the warm-up's lazy initializations stay out of the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        fn()
    return graph


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def time_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    """A plot's axes as the benchmarks draw them: time on a log scale over an x from 0, gridded."""
    ax.set_yscale("log")
    ax.set_xlim(left=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)


def write_results(name: str, payload: dict, table: str, title: str, notes: str = "") -> Path:
    """Write ``<name>.json`` and ``<name>.md`` under the results folder; return the .md path."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    env = environment()
    (OUT_DIR / f"{name}.json").write_text(json.dumps({"env": env, **payload}, indent=2))
    md = (f"# {title}\n\n{env['date']}, {env['device']}, torch {env['torch']} "
          f"(CUDA {env['cuda']}), commit {env['commit']}.\n\n{table}\n")
    if notes:
        md += f"\n{notes}\n"
    path = OUT_DIR / f"{name}.md"
    path.write_text(md)
    return path
