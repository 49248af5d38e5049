"""The tier chooser: which implementation runs a dynamic Linear update, picked by measuring.

``quality="auto"`` (the default) runs each low-rank Linear update by whichever of its
implementations measured fastest for that layer's shape on that device:

    lossless     the base layer's own GEMM, then the update beside it (any device)
    fused        the Triton kernels: the shrink, then one kernel over x W^T and S B^T
    fused_cute   the same with the CuTe-DSL Hopper GEMM for the second kernel (the ``hopper``
                 extra on an sm_90 device)
    fused_cute_shrink
                 one CuTe-DSL kernel computing the shrink among its own work units (x read
                 from memory once; ranks up to 128)
    fused_cute_pingpong
                 fused_cute with the ping-pong tile (one warpgroup's epilogue under the
                 other's main loop: faster or slower by the shape and the card's clocks)

Which is fastest depends on the shape (fused saves a pass over the output; its launches cost
host time), on the device, and on how the model runs: eagerly a layer's host time can exceed
its GPU time, under CUDA graphs only GPU time counts. So each candidate is measured four ways,
the first time a (device, dtype, row bucket, N, K, R, bias) key is seen, on the call's own
input:

    eager    CUDA events around a burst of back-to-back calls (the host issuing them is part of
             the measurement: if it cannot keep up, the GPU idles and the events see it)
    graphs   the same burst captured once in a CUDA graph and replayed (GPU time alone)
    host     the clock around the burst's issue alone (the host's time per call)
    idle     CUDA events around one call issued to an idle device (its latency: the host's
             issue until the last kernel's end, as a layer run on its own, or after a sync,
             takes it)

each mode measuring every candidate before the next mode begins, in rounds whose orders form a
Williams design (:func:`round_orders`), the mean over the rounds kept. The device's clocks move
while it is measured: they drift (a long GEMM heats it), and after a kernel that draws more
power the power limit holds them lower for a while, so whatever is measured next runs slower.
In the design every candidate is measured in every place of a round equally often, so a steady
drift adds the same to each candidate's mean, and within a round after every other candidate
equally often (never twice in a row, from three candidates on), so each one's after-effect
falls on all of them alike. The
drift is steepest first (an idle device boosts its first milliseconds): lossless runs for
:data:`WARM_SECONDS` before anything is timed. The
forward asks for the eager choice, or for the graphs choice while a CUDA graph is being
captured. The graphs choice is the fastest replay. The eager choice is the fastest burst among
the candidates whose host time is no more than lossless's (within :data:`MARGIN` of lossless's
call) and whose idle latency is no more than lossless's: a burst of one layer lets a slow
launcher hide under the layer's own GPU time, but in a model whose forward is bound by the host
(many small layers, or a small batch) every extra microsecond of host time is a microsecond of
the forward, and a call from an idle device waits for its launches in order (lossless's base
GEMM starts computing while its update is issued; a fused tier's GEMM waits for the shrink's
launch and its own). A key's measurement is cached for the process (:data:`TIERS`); lossless
wins unless another implementation is faster by more than :data:`MARGIN` (:data:`GRAPHS_MARGIN`
in graphs), and stands in wherever nothing was measured (off CUDA, under ``torch.compile``,
while autograd records, or for a first call made during a capture, when nothing can be timed).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from shuttle.kernels.lora_linear_tma import FUSED_FORMS

__all__ = ["GRAPHS_MARGIN", "MARGIN", "MODES", "TIERS", "WARM_SECONDS", "TierChoice",
           "TierChooser", "TierKey", "round_orders", "row_bucket", "warm_device"]

# The implementations a Linear update can run by, in the order ties are broken.
IMPLEMENTATIONS: tuple[str, ...] = ("lossless", *FUSED_FORMS)

# Another implementation replaces lossless only when it is this much faster (a relative
# margin above the run-to-run spread of the bursts' medians): eagerly, where the host's
# timing is part of the measurement; in graphs, GPU time alone, whose replays spread less.
MARGIN = 0.03
GRAPHS_MARGIN = 0.01
# What a candidate is measured by (the module docstring): seconds per call each.
MODES: tuple[str, ...] = ("eager", "graphs", "host", "idle")
# Untimed calls before each measure() call: lazy initialization (a first compile, a capture's
# warm-up) stays out of the timing; a round visits every candidate, so one is enough.
_WARMUP = 1
# Seconds of back-to-back calls before a key's measurement: a device that was idle runs its
# first milliseconds of work at boost clocks, which would favour whatever is measured first.
WARM_SECONDS = 0.05
_BURST = 10
_REPEATS = 1  # bursts per measure() call: one per round (the rounds give the repeats)
_VISITS = 6  # rounds per mode at least (round_orders' design repeated until there are)


@dataclasses.dataclass(frozen=True)
class TierKey:
    """What a measurement holds for: layers of one shape on one device, at one row bucket."""

    device: str
    dtype: torch.dtype
    rows: int  # the call's rows rounded up to a power of two (row_bucket)
    n: int
    k: int
    r: int
    bias: bool


@dataclasses.dataclass(frozen=True)
class TierChoice:
    """A key's measurement: seconds per call of each candidate eagerly, in graphs (inf: could
    not run that way), of host time and from an idle device, and the fastest. Every candidate
    is in all four (lossless always: it is never dropped).
    """

    eager: dict[str, float]
    graphs: dict[str, float]
    host: dict[str, float]
    idle: dict[str, float]

    def best(self, graphs: bool) -> str:
        """The fastest candidate; lossless unless another beats it by more than
        :data:`MARGIN` (in graphs :data:`GRAPHS_MARGIN`: timing noise must not make the
        default slower than lossless), and eagerly only among candidates that cost the host
        no more than lossless does and are no slower from an idle device.
        """
        times = self.graphs if graphs else self.eager
        if not graphs:
            # The host time lossless's call may grow by without the choice being a gamble
            # on the model's GPU keeping the host's extra time hidden.
            allowed = self.host["lossless"] + MARGIN * times["lossless"]
            times = {name: t for name, t in times.items() if name == "lossless" or (
                self.host[name] <= allowed and self.idle[name] <= self.idle["lossless"])}
        # min over the candidates in IMPLEMENTATIONS order: the first of equals wins
        fastest = min(times, key=lambda name: (times[name], IMPLEMENTATIONS.index(name)))
        if times[fastest] > times["lossless"] * (1 - (GRAPHS_MARGIN if graphs else MARGIN)):
            return "lossless"
        return fastest


def round_orders(n: int) -> list[list[int]]:
    """The orders in which ``n`` candidates are measured, one list of their indices per round:
    a Williams design, ``n`` rounds for an even ``n`` and ``2n`` for an odd one (the second half
    the first reversed), chained so that no round begins with the candidate the round before
    it ended with (impossible for one or two candidates).

    Over the rounds every index takes every place equally often, and within the rounds follows
    every other index equally often.
    """
    first = [0]  # 0, 1, n-1, 2, n-2, ...: the differences of neighbours are all distinct mod n
    for i in range(1, n):
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    rows = [[(v + r) % n for v in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    chain = [rows.pop(0)]
    while rows:
        after = next((row for row in rows if row[0] != chain[-1][-1]), rows[0])
        rows.remove(after)
        chain.append(after)
    return chain


def row_bucket(rows: int) -> int:
    """``rows`` rounded up to a power of two: calls within a factor of two share a choice."""
    return 1 << max(0, rows - 1).bit_length()


Measure = Callable[[Callable[[], object], str], float]


def measure_call(fn: Callable[[], object], mode: str) -> float:
    """Seconds per call of ``fn`` in ``mode`` (one of :data:`MODES`): the median of
    ``_REPEATS`` bursts of back-to-back calls (one: the chooser's rounds repeat each
    measurement and it keeps their mean), timed by CUDA events on a CUDA device (eagerly or
    replayed from a captured graph), by the clock around the burst's issue for ``"host"``, and
    by the clock off CUDA (where there are no graphs: inf); for ``"idle"`` the median of
    ``2 * _REPEATS`` single calls each issued to a drained device.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    graphs = mode == "graphs"
    for _ in range(_WARMUP):
        fn()
    if mode == "host":
        return _host_seconds(fn)
    if mode == "idle":
        return _idle_seconds(fn)
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        if graphs:
            return float("inf")
        samples = []
        for _ in range(_REPEATS):
            start = time.perf_counter()
            for _ in range(_BURST):
                fn()
            samples.append((time.perf_counter() - start) / _BURST)
        return statistics.median(samples)
    stream = torch.cuda.current_stream()
    run = fn
    if graphs:
        graph = torch.cuda.CUDAGraph()
        side = _capture_stream(stream.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            fn()  # warm on the side stream, as capture requires
        stream.wait_stream(side)
        try:
            with torch.cuda.graph(graph):
                for _ in range(_BURST):
                    fn()
        except RuntimeError:
            return float("inf")  # this candidate cannot be captured
        run = graph.replay
    samples = []
    for _ in range(_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        if graphs:
            run()
        else:
            for _ in range(_BURST):
                run()
        end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / _BURST)
    return statistics.median(samples)


def _host_seconds(fn: Callable[[], object]) -> float:
    """The host's seconds per call of ``fn``: the clock around a burst's issue, the device
    drained before each burst (a launch never waits for a full queue), the median of
    ``_REPEATS`` bursts.
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    samples = []
    for _ in range(_REPEATS):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(_BURST):
            fn()
        samples.append((time.perf_counter() - start) / _BURST)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(samples)


def _idle_seconds(fn: Callable[[], object]) -> float:
    """Seconds of one call of ``fn`` issued to a drained device, from before its issue to its
    last kernel's end (CUDA events; the clock off CUDA), the median of ``2 * _REPEATS`` calls.
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    samples = []
    for _ in range(_REPEATS * 2):
        if not cuda:
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
            continue
        stream = torch.cuda.current_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def warm_device(fn: Callable[[], object]) -> None:
    """Call ``fn`` back to back for :data:`WARM_SECONDS` on a CUDA device (nothing off CUDA),
    so that the measurements after it start at the clocks a busy device settles at.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    deadline = time.perf_counter() + WARM_SECONDS
    while time.perf_counter() < deadline:
        for _ in range(_BURST):
            fn()
        torch.cuda.synchronize()


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream measurements warm up and capture on, one per device: cuBLAS keeps a
    workspace (32 MiB on Hopper, from the caching allocator, for the process's life) for every
    stream a matmul ran on, so a fresh stream per measurement would hold device memory no plan
    counts.
    """
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


class TierChooser:
    """Measurements per :class:`TierKey`, taken once each (see the module docstring).

    Args:
        measure: ``measure(fn, mode) -> seconds per call``, ``mode`` one of :data:`MODES`;
            :func:`measure_call` by default (tests pass their own).
        devices: the device types whose calls are measured; elsewhere the forward runs
            lossless without measuring (off CUDA the fused kernels are Triton's interpreter,
            there for tests, never the faster one).
        warm: ``warm(fn)``, run with lossless's call before a key's measurement
            (:func:`warm_device` by default; None: no warm-up).
    """

    def __init__(self, measure: Measure = measure_call,
                 devices: tuple[str, ...] = ("cuda",),
                 warm: Callable[[Callable[[], object]], None] | None = warm_device) -> None:
        self.measure = measure
        self.devices = devices
        self.warm = warm
        self.choices: dict[TierKey, TierChoice] = {}
        self.generation = 0  # moves on clear(): whoever keeps picks asks again

    def choose(self, key: TierKey, candidates: dict[str, Callable[[], object]], *,
               graphs: bool = False) -> str:
        """The fastest of ``candidates`` (name -> a call running that implementation on the
        layer's input) for ``key``, measuring them if ``key`` was not measured yet.

        Candidates are measured in every mode of :data:`MODES`; a candidate that raises is
        dropped. Only "lossless" is never dropped: it is what the forward runs without a
        measurement.
        """
        choice = self.choices.get(key)
        if choice is None:
            # Mode by mode, in the rounds of round_orders (see the module docs): a steady
            # drift of the device's clocks adds the same to each candidate's mean, and each
            # candidate's after-effect on the clocks falls on every other alike.
            samples: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
            live = dict(candidates)
            names = list(live)
            orders = round_orders(len(names))
            orders *= -(-_VISITS // len(orders))
            if self.warm is not None:
                self.warm(live["lossless"])
            for mode in MODES:
                for order in orders:
                    for name in (names[i] for i in order):
                        if name not in live:
                            continue
                        try:
                            t = self.measure(live[name], mode)
                        except Exception:
                            if name == "lossless":
                                raise
                            del live[name]
                            continue
                        samples[mode].setdefault(name, []).append(t)
            times = {mode: {name: statistics.fmean(ts) for name, ts in by.items() if name in live}
                     for mode, by in samples.items()}
            choice = self.choices[key] = TierChoice(**times)
        return choice.best(graphs)

    def known(self, key: TierKey, *, graphs: bool) -> str | None:
        """The choice for ``key`` if it was measured, else None (nothing is measured)."""
        choice = self.choices.get(key)
        return None if choice is None else choice.best(graphs)

    def clear(self) -> None:
        """Forget every measurement (the next call of each key measures again)."""
        self.choices.clear()
        self.generation += 1


# The process's measurements, shared by every attachment: layers of one shape measure once.
TIERS = TierChooser()
