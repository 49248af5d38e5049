"""What one launch costs the host, and how many a LoRA training step makes.

A step whose host work outlasts its GPU work runs at the host's pace; a rank-16 adapter's
products are small kernels, so their host cost per launch, times their number, decides whether
a short block (the q/k/v/o projections alone) is bound by the host. Two parts, one run:

- the host time to issue one call of each product the training functions are made of, at the
  q/k/v/o block's shapes (T 8192, K 4096, N 1024 or 4096, rank 16, three adapters 48): the
  median over ``CALLS`` calls, the GPU drained before each batch of ``BATCH`` (so no call waits
  for a full launch queue), and the same call on 16-element CPU tensors (the call without
  CUDA: Python, the dispatcher and a tiny CPU kernel);
- per step of the q/k/v/o block (``benchmarks/training.py``'s, rank 16 on every projection):
  the kernels it launches and the aten operators it calls (torch.profiler, over ``STEPS``
  steps), and its host time with autograd's backward on its CUDA device thread (the default)
  and on the calling thread (``torch.autograd.set_multithreading_enabled(False)``): frozen,
  PEFT, shuttle.

Writes docs/benchmarks/launch_cost.{json,md}.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import training  # noqa: E402
from shuttle.train import accelerate  # noqa: E402
from shuttle.train.products import scaled_mm  # noqa: E402

CALLS, BATCH, STEPS, ROUNDS = 400, 20, 10, 4
T, K, N, R = training.TOKENS, training.HIDDEN, training.KV, training.RANK
DEVICE = training.DEVICE


def issue_us(fn, calls: int = CALLS) -> float:
    """Median host microseconds per call of ``fn()``, batches of ``BATCH`` from a drained GPU."""
    per_call = []
    fn()
    for _ in range(max(1, calls // BATCH)):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(BATCH):
            fn()
        per_call.append((time.perf_counter() - t0) / BATCH * 1e6)
    return statistics.median(per_call)


def products(device: str, small: bool) -> dict[str, callable]:
    """The training functions' products, as they issue them (``small``: 4 x 4 operands, for
    the same calls on the CPU)."""
    t, k, n, r = (4, 4, 4, 4) if small else (T, K, N, R)
    bf = dict(device=device, dtype=torch.bfloat16)
    x, w = torch.randn(t, k, **bf), torch.randn(n, k, **bf)
    a3 = torch.randn(3 * r, k, **bf)
    h, b = torch.randn(t, r, **bf), torch.randn(k, r, **bf)
    u3 = torch.randn(t, 3 * r, **bf)
    y = torch.randn(t, k, **bf)
    fp32 = torch.randn(r, k, device=device)
    tiny = torch.randn(16, device=device)
    ops = {
        "torch.empty (T, r)": lambda: torch.empty(t, r, **bf),
        "add_ of 16 elements": lambda: tiny.add_(1),
        "factor cast float32 -> bf16 (r, K)": lambda: fp32.to(torch.bfloat16),
        "base GEMM F.linear(x, W)": lambda: torch.nn.functional.linear(x, w),
        "shrink F.linear(x, A) of 3 adapters": lambda: torch.nn.functional.linear(x, a3),
        "expand addmm(out=new, beta=0, alpha=s)": lambda: scaled_mm(h, b.T, 2.0),
        "expand into the output y.addmm_(h, B^T)": lambda: y.addmm_(h, b.T, alpha=2.0),
        "dx = u A (mm)": lambda: u3 @ a3,
    }
    if device == "cuda":  # float32 gradients out of the GEMM (CUDA only)
        ops["dA = u^T x, float32 out (mm out_dtype)"] = lambda: torch.mm(
            u3.T, x, out_dtype=torch.float32)
    return ops


def block_steps() -> dict[str, dict]:
    """Kernels, aten operators and host time per step of the q/k/v/o block."""
    from torch.profiler import ProfilerActivity, profile

    dense = training.dense_block(training.Projections)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    lora = training._peft(copy.deepcopy(dense), targets)
    fast = copy.deepcopy(lora)
    accelerate(fast)
    xs, dys = training.block_inputs(dense)
    steps = {key: (training._step_fn(model, xs, dys),
                   training._step_fn(model, xs, dys, calling_thread=True))
             for key, model in (("frozen", dense), ("peft", lora), ("shuttle", fast))}
    if DEVICE != "cuda":  # the smoke run: the steps run, nothing is timed
        for step, calling in steps.values():
            step(0)
            calling(1)
        fields = ("kernels", "top_level_aten_ops", "host_ms", "host_ms_calling_thread")
        return {key: dict.fromkeys(fields, float("nan")) for key in steps}
    rows: dict[str, dict] = {key: {} for key in steps}
    for _ in range(ROUNDS):  # host times first, interleaved: no profiler ran in this process
        for key, (step, calling) in steps.items():
            for name, fn in (("host_ms", step), ("host_ms_calling_thread", calling)):
                rows[key].setdefault(name, []).append(harness.host_ms(fn, n=40))
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    for key, (step, _) in steps.items():
        row = rows[key]
        for name in ("host_ms", "host_ms_calling_thread"):
            row[name + "_rounds"] = row[name]
            row[name] = statistics.median(row[name])
        torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            for i in range(STEPS):
                step(i)
            torch.cuda.synchronize()
        events = prof.events()
        row["kernels"] = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                             and not e.name.startswith(harness._PROFILER_OVERHEAD)) / STEPS
        row["top_level_aten_ops"] = sum(
            1 for e in events if e.device_type == torch.autograd.DeviceType.CPU
            and e.name.startswith("aten::")
            and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))) / STEPS
        print(key, row, flush=True)
    return rows


def _spread(row: dict, name: str) -> str:
    """``median (min-max over the rounds)`` of a host time."""
    rounds = row.get(name + "_rounds")
    if not rounds:
        return f"{row[name]:.2f}"
    return f"{row[name]:.2f} ({min(rounds):.2f}-{max(rounds):.2f})"


def main() -> None:
    harness.spin_up()
    launch = {}
    cpu = products("cpu", small=True)
    for name, fn in products(DEVICE, small=False).items():
        launch[name] = {"device_us": issue_us(fn),
                        "cpu_us": issue_us(cpu[name]) if name in cpu else float("nan")}
        print(name, launch[name], flush=True)
    steps = block_steps()
    table = harness.markdown_table(
        ["product (q/k/v/o shapes)", "host µs to issue, CUDA", "same call on CPU tensors, µs"],
        [[k, f"{v['device_us']:.1f}", f"{v['cpu_us']:.1f}"] for k, v in launch.items()])
    table += "\n\n" + harness.markdown_table(
        ["q/k/v/o step", "kernels", "aten operators", "host ms (default)",
         "host ms (backward on the calling thread)"],
        [[k, f"{v['kernels']:.0f}", f"{v['top_level_aten_ops']:.0f}", _spread(v, "host_ms"),
          _spread(v, "host_ms_calling_thread")] for k, v in steps.items()])
    notes = (f"Host time to issue one call: median over {CALLS} calls in batches of {BATCH}, "
             "the GPU drained before each batch; the CPU column is the same call on 16-element "
             "CPU tensors (the call without CUDA: Python, the dispatcher and a tiny CPU "
             "kernel). Steps: the q/k/v/o block of "
             f"benchmarks/training.py (bf16, T {T}, rank {R}); kernels (cuBLAS memsets "
             "included) and top-level aten operators per step from torch.profiler over "
             f"{STEPS} steps; host ms: one step issued from a drained GPU, the median of 40 in "
             f"each of {ROUNDS} interleaved rounds: the median round (the fastest and slowest).")
    harness.write_results("launch_cost", {"launch_us": launch, "steps": steps}, table,
                          "Host cost of a launch (benchmarks/launch_cost.py)", notes)
    print(table)
    print(notes)


if __name__ == "__main__":
    main()
