"""LoRA training speed and memory: shuttle.train.accelerate against PEFT, one interleaved run.

Llama-3.1-8B shapes, bf16, 8192 tokens, rank 16, every projection adapted, forward + backward
with the input requiring grad (as inside a model), CUDA events, medians of interleaved rounds
with the inputs rotated. Each variant is timed two ways: one step from a drained GPU (its
latency: the host's launch time shows wherever it exceeds the GPU's queue), and a loop of
``LOOP`` steps issued back to back with one sync at the end, per step (a training loop's
throughput: no step waits for the previous one to finish, so the host issues the next step's
work while the GPU runs this one's):

    frozen     the same block without LoRA (the floor the adapter's work is measured against)
    peft       PEFT's LoRA layers (get_peft_model defaults: float32 adapters on the bf16 base)
    shuttle    the same PEFT model after shuttle.train.accelerate

Blocks: the SwiGLU MLP (gate 4096->14336, up, down) and the q/k/v/o projections (GQA:
4096->4096, 1024, 1024; o 4096->4096; attention itself left out). The MLP again over an NF4
base (bitsandbytes Linear4bit): PEFT + bitsandbytes against shuttle. Peak memory is the
largest allocation above what the block's weights and inputs hold before the step. The
q/k/v/o block once more with every variant captured in CUDA graphs
(``torch.cuda.make_graphed_callables``: the host's launches taken out of the step), and
eager with every variant's backward on the calling thread (autograd's own device thread
otherwise takes the backward over, and wakes the caller when it is done). Then a
whole model step: a 2-layer Llama of real width (vocab 32000, 4096 tokens), loss.backward(),
frozen / PEFT / shuttle.

Writes docs/benchmarks/training.{json,md}.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from shuttle.train import accelerate  # noqa: E402

HIDDEN, MLP, KV, TOKENS, RANK, VOCAB = 4096, 14336, 1024, 8192, 16, 32000
LOOP = 32  # steps per timed loop: enough that the first step's wait for the host is amortized
DEVICE = "cuda"
if os.environ.get("SHUTTLE_BENCH_SMOKE"):  # tiny shapes on the CPU: the script runs through
    HIDDEN, MLP, KV, TOKENS, RANK, VOCAB, DEVICE = 64, 128, 32, 64, 4, 128, "cpu"


def SwiGLU() -> nn.Module:  # noqa: N802 - stands for the class
    """transformers' LlamaMLP at these shapes."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP))


class Projections(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        return self.o_proj(q), k, v


def _peft(model: nn.Module, targets: list[str]) -> nn.Module:
    import peft

    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets,
                             lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _nf4_mlp(dense: nn.Module) -> nn.Module:
    """A copy of ``dense`` (an MLP) with NF4 bitsandbytes projections of its weights."""
    import bitsandbytes as bnb

    q = copy.deepcopy(dense).cpu()
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(q, name)
        new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False,
                                quant_type="nf4", compute_dtype=torch.bfloat16)
        new.weight = bnb.nn.Params4bit(lin.weight.detach().float(), requires_grad=False,
                                       quant_type="nf4")
        setattr(q, name, new)
    return q.to(DEVICE)


def _step_fn(model: nn.Module, xs: list[torch.Tensor], dys: list,
             calling_thread: bool = False) -> callable:
    """One training step of ``model``; ``calling_thread``: autograd runs the backward on the
    calling thread rather than handing it to its CUDA device thread and back."""
    params = [p for p in model.parameters() if p.requires_grad]  # an optimizer's list

    def step(i: int) -> None:
        x = xs[i % len(xs)]
        out = model(x)
        outs = out if isinstance(out, tuple) else (out,)
        if calling_thread:
            with torch.autograd.set_multithreading_enabled(False):
                torch.autograd.backward(outs, dys[i % len(dys)])
        else:
            torch.autograd.backward(outs, dys[i % len(dys)])
        x.grad = None
        for p in params:
            p.grad = None
    return step


def _timed(variants: dict[str, callable], rounds: int
           ) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms per variant: one step from a drained GPU, and per step of ``LOOP`` steps
    issued back to back (inputs rotated as in single steps); each an interleaved run."""
    def looped(step: callable) -> callable:
        def loop(i: int) -> None:
            for j in range(LOOP):
                step(i * LOOP + j)
        return loop

    one = harness.interleaved(variants, rounds=rounds)
    loops = harness.interleaved({k: looped(fn) for k, fn in variants.items()}, rounds=rounds)
    return ({k: v["median_ms"] for k, v in one.items()},
            {k: v["median_ms"] / LOOP for k, v in loops.items()})


def _peak_gib(fn) -> float:
    if DEVICE == "cpu":
        fn(0)
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(0)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def _graphed(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """``model`` with its forward and backward captured in CUDA graphs (one launch each)."""
    return torch.cuda.make_graphed_callables(model, (x.detach().clone().requires_grad_(),))


def dense_block(make) -> nn.Module:
    """``make()`` in bf16 on the device, frozen, its weights drawn N(0, 0.02) after seed 0."""
    torch.manual_seed(0)
    dense = make().to(DEVICE, torch.bfloat16).requires_grad_(False)
    for p in dense.parameters():
        p.data.normal_(0, 0.02)
    return dense


def block_inputs(dense: nn.Module) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Three inputs of a block (requiring grad, as inside a model) and three sets of gradients
    of its outputs, to rotate through."""
    xs = [torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
          for _ in range(3)]
    with torch.no_grad():
        out = dense(xs[0])
    outs = out if isinstance(out, tuple) else (out,)
    return xs, [[torch.randn_like(o) for o in outs] for _ in range(3)]


def bench_block(name: str, make, targets: list[str], nf4: bool, rounds: int,
                graphed: bool = False, calling_thread: bool = False) -> dict:
    dense = dense_block(make)
    frozen = _nf4_mlp(dense) if nf4 else dense
    lora = _peft(copy.deepcopy(frozen) if not nf4 else _nf4_mlp(dense), targets)
    fast = copy.deepcopy(lora) if not nf4 else _peft(_nf4_mlp(dense), targets)
    if nf4:  # the same adapter values in both
        fast.load_state_dict({k: v for k, v in lora.state_dict().items() if "lora_" in k},
                             strict=False)
    report = accelerate(fast)
    xs, dys = block_inputs(dense)
    if graphed:  # every variant captured alike: the host's launches out of the step
        frozen, lora, fast = (_graphed(m, xs[0]) for m in (frozen, lora, fast))
    variants = {k: _step_fn(m, xs, dys, calling_thread)
                for k, m in (("frozen", frozen), ("peft", lora), ("shuttle", fast))}
    # the same numbers: shuttle's gradients against PEFT's
    grads = {}
    for key in ("peft", "shuttle"):
        model = lora if key == "peft" else fast
        o = model(xs[0])
        torch.autograd.backward(o if isinstance(o, tuple) else (o,), dys[0])
        grads[key] = {n: p.grad.float().clone() for n, p in model.named_parameters()
                      if p.grad is not None}
        grads[key]["x"] = xs[0].grad.float().clone()
        xs[0].grad = None
        for p in model.parameters():
            p.grad = None
    err = max(((grads["shuttle"][n] - g).norm() / g.norm()).item()
              for n, g in grads["peft"].items())
    peak = {k: _peak_gib(fn) for k, fn in variants.items()}
    ms, loop_ms = _timed(variants, rounds)
    # where a step's time goes: the GPU's kernels, and the host's Python and launches
    gpu = {k: harness.gpu_ms(fn) for k, fn in variants.items()} if DEVICE == "cuda" else {}
    host = {k: harness.host_ms(fn) for k, fn in variants.items()} if DEVICE == "cuda" else {}
    row = {"block": name, "nf4": nf4, "graphed": graphed, "calling_thread": calling_thread,
           "ms": ms, "loop_ms": loop_ms,
           "peak_extra_gib": peak,
           "gpu_ms": gpu, "host_ms": host,
           "shuttle_vs_frozen_gpu": gpu["shuttle"] / gpu["frozen"] if gpu else float("nan"),
           "shuttle_vs_frozen": ms["shuttle"] / ms["frozen"],
           "shuttle_vs_frozen_loop": loop_ms["shuttle"] / loop_ms["frozen"],
           "peft_vs_shuttle_loop": loop_ms["peft"] / loop_ms["shuttle"],
           "peft_vs_frozen": ms["peft"] / ms["frozen"],
           "peft_vs_shuttle": ms["peft"] / ms["shuttle"],
           "grad_rel_err_vs_peft": err, "patched": sorted(set(report.patched.values()))}
    print(row, flush=True)
    del lora, fast, frozen, dense
    torch.cuda.empty_cache()
    return row


def bench_model(rounds: int) -> dict:
    """A whole training step of a 2-layer Llama of real width: the frozen model, PEFT, and
    shuttle. Every variant is fed the input embeddings as a leaf that requires grad, so the
    frozen model runs the same backward through every layer (its step is the floor the
    adapters' cost is measured against)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP,
                                   num_hidden_layers=2, num_attention_heads=32,
                                   num_key_value_heads=8, max_position_embeddings=8192)
    base = transformers.LlamaForCausalLM(cfg).to(DEVICE, torch.bfloat16)
    frozen = copy.deepcopy(base).requires_grad_(False)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = _peft(base, targets)
    fast = copy.deepcopy(lora)
    report = accelerate(fast)
    ids = [torch.randint(0, VOCAB, (1, TOKENS // 2), device=DEVICE) for _ in range(3)]
    with torch.no_grad():
        embeds = [frozen.get_input_embeddings()(i).requires_grad_() for i in ids]

    def step_of(model):
        params = [p for p in model.parameters() if p.requires_grad]

        def step(i):
            e = embeds[i % 3]
            out = model(inputs_embeds=e, labels=ids[i % 3])
            out.loss.backward()
            e.grad = None
            for p in params:
                p.grad = None
        return step

    variants = {"frozen": step_of(frozen), "peft": step_of(lora), "shuttle": step_of(fast)}
    peak = {k: _peak_gib(fn) for k, fn in variants.items()}
    ms, loop_ms = _timed(variants, rounds)
    gpu = {k: harness.gpu_ms(fn) for k, fn in variants.items()} if DEVICE == "cuda" else {}
    host = {k: harness.host_ms(fn) for k, fn in variants.items()} if DEVICE == "cuda" else {}
    row = {"ms": ms, "loop_ms": loop_ms, "peak_extra_gib": peak, "gpu_ms": gpu, "host_ms": host,
           "shuttle_vs_frozen": ms["shuttle"] / ms["frozen"],
           "shuttle_vs_frozen_loop": loop_ms["shuttle"] / loop_ms["frozen"],
           "peft_vs_frozen": ms["peft"] / ms["frozen"],
           "peft_vs_frozen_loop": loop_ms["peft"] / loop_ms["frozen"],
           "peft_vs_shuttle": ms["peft"] / ms["shuttle"],
           "peft_vs_shuttle_loop": loop_ms["peft"] / loop_ms["shuttle"],
           "patched": report.summary()}
    print(row, flush=True)
    return row


def peaks(b: dict) -> list[str]:
    """The peak-memory cells of a row: none for captured variants (a graph's memory is
    allocated in its own pool when it is captured, not during the step)."""
    if b.get("graphed"):
        return ["n/a"] * 3
    pk = b["peak_extra_gib"]
    return [f"{pk['frozen']:.2f}", f"{pk['peft']:.2f}", f"**{pk['shuttle']:.2f}**"]


def write(blocks: list[dict], model: dict | None) -> None:
    rows = []
    for b in blocks:
        ms = b["ms"]
        label = b["block"] + (" (NF4 base)" if b["nf4"] else "") + (
            ", CUDA graphs" if b.get("graphed") else "") + (
            ", backward on the calling thread" if b.get("calling_thread") else "")
        lp = b["loop_ms"]
        rows.append([label, f"{ms['frozen']:.2f}",
                     f"{ms['peft']:.2f}", f"**{ms['shuttle']:.2f}**",
                     f"{b['peft_vs_frozen']:.2f}x", f"**{b['shuttle_vs_frozen']:.2f}x**",
                     f"{b['peft_vs_shuttle']:.2f}x",
                     " / ".join(f"{lp[k]:.2f}" for k in ("frozen", "peft", "shuttle")),
                     f"**{b['shuttle_vs_frozen_loop']:.2f}x**", f"{b['peft_vs_shuttle_loop']:.2f}x",
                     f"{b['shuttle_vs_frozen_gpu']:.2f}x",
                     " / ".join(f"{b['host_ms'].get(k, float('nan')):.2f}"
                                for k in ("frozen", "peft", "shuttle")),
                     *peaks(b), f"{b['grad_rel_err_vs_peft']:.1e}"])
    table = harness.markdown_table(
        ["block", "frozen ms", "PEFT ms", "shuttle ms", "PEFT / frozen", "shuttle / frozen",
         "PEFT / shuttle", f"loop of {LOOP}, ms per step (frozen / PEFT / shuttle)",
         "shuttle / frozen, loop", "PEFT / shuttle, loop", "shuttle / frozen, GPU work",
         "host ms (frozen / PEFT / shuttle)",
         "frozen peak GiB", "PEFT peak GiB", "shuttle peak GiB", "grad rel. err vs PEFT"], rows)
    notes = ("bf16, 8192 tokens, hidden 4096, MLP 14336, rank 16, forward + backward with the "
             "input requiring grad; medians of interleaved rounds, inputs rotated. The first "
             f"columns time one step from a drained GPU; \"loop\" times {LOOP} steps issued "
             "back to back with one sync at the end, per step (a training loop's throughput). "
             "Peak: GiB "
             "allocated above the block's weights and inputs during one step. PEFT uses its "
             "defaults (float32 adapters on the bf16 base); the gradient error is "
             "|g_shuttle - g_PEFT| / |g_PEFT| (largest over parameters and the input). "
             "GPU work: the step's kernel time (profiled); host ms: the time the host takes to "
             "issue one step (Python and launches, from a drained GPU). A step takes the "
             "larger of the two, plus the first launch's latency. CUDA graphs: each variant "
             "captured by torch.cuda.make_graphed_callables (forward and backward one graph "
             "launch each, the input copied into the graph's own; their peak is not "
             "measured: a graph's memory is allocated in its own pool when it is captured). "
             "Backward on the calling thread: every variant's backward run under "
             "torch.autograd.set_multithreading_enabled(False) (by default autograd hands a "
             "CUDA backward to its device thread and wakes the caller when it is done).")
    if model is not None:
        ms, lp, pk = model["ms"], model["loop_ms"], model["peak_extra_gib"]
        gpu, host = model.get("gpu_ms", {}), model.get("host_ms", {})
        work = ""
        if gpu and host:
            work = (" GPU work / host ms per step: " + ", ".join(
                f"{k} {gpu[k]:.1f} / {host[k]:.1f}" for k in ("frozen", "peft", "shuttle"))
                + ".")
        notes += (f"\n\nWhole step of a 2-layer Llama of real width (vocab 32000, 4096 tokens, "
                  f"every projection adapted, the input embeddings a leaf requiring grad): "
                  f"frozen {ms['frozen']:.1f} ms, PEFT {ms['peft']:.1f} ms "
                  f"({model['peft_vs_frozen']:.2f}x the frozen step), shuttle "
                  f"{ms['shuttle']:.1f} ms ({model['shuttle_vs_frozen']:.2f}x; "
                  f"{model['peft_vs_shuttle']:.2f}x faster than PEFT); in a loop of {LOOP} "
                  f"steps, per step: {lp['frozen']:.1f} / {lp['peft']:.1f} / "
                  f"{lp['shuttle']:.1f} ms ({model['shuttle_vs_frozen_loop']:.2f}x the frozen "
                  f"step; {model['peft_vs_shuttle_loop']:.2f}x faster than PEFT); peak extra "
                  f"{pk['frozen']:.2f} / {pk['peft']:.2f} / {pk['shuttle']:.2f} GiB.{work}")
    harness.write_results("training", {"blocks": blocks, "model": model}, table,
                          "LoRA training (benchmarks/training.py)", notes)
    print(table)
    print(notes)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    harness.spin_up()
    mlp_t = ["gate_proj", "up_proj", "down_proj"]
    blocks = []
    qkvo = ["q_proj", "k_proj", "v_proj", "o_proj"]
    cases = [("SwiGLU MLP", SwiGLU, mlp_t, False, False, False),
             ("q, k, v, o projections", Projections, qkvo, False, False, False),
             ("q, k, v, o projections", Projections, qkvo, False, False, True)]
    if DEVICE == "cuda":
        cases.append(("q, k, v, o projections", Projections, qkvo, False, True, False))
    cases.append(("SwiGLU MLP", SwiGLU, mlp_t, True, False, False))
    for name, make, targets, nf4, graphed, calling_thread in cases:
        try:
            blocks.append(bench_block(name, make, targets, nf4, rounds, graphed, calling_thread))
        except ImportError as e:  # bitsandbytes missing: recorded, not hidden
            print(f"{name} nf4={nf4}: skipped ({e})", flush=True)
        write(blocks, None)
    write(blocks, bench_model(max(5, rounds // 2)))


if __name__ == "__main__":
    main()
