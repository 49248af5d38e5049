"""Lossless-coded bf16 weights: ratio, encode time, GPU decode throughput (issue 40).

Three parts, one run:

    ratio    per model (Flux-dev transformer, T5-XXL encoder, a Llama-3-8B shape): every weight
             shape of the model built on ``meta`` from its real config, filled with Gaussian
             values at a per-tensor scale (std 1/sqrt(fan_in) x a factor drawn in [0.5, 2]),
             coded by :class:`shuttle.weights.LosslessTensor` on the CPU. ``--sample`` tensors
             per distinct shape are coded and the rest counted at their shape's ratio.
    decode   GPU decode throughput (GB/s of bf16 written) of each Triton decoder (``triton_<name>``
             for each of ``shuttle.kernels.exponent_decode.DECODE_KERNELS``), on rotated
             tensors of the Flux double block's largest shape, CUDA events after warm-up,
             median; beside it a device-to-device copy of the bf16 bytes (the memory ceiling)
             and, when ``nvidia.nvcomp`` imports, nvCOMP's ANS and Bitcomp decoders on the
             same bf16 bytes (the other design: codes a byte stream, not our split).
    check    every decoded tensor equals its source bit for bit (a mismatch aborts the run).
    capture  where coding at capture goes (``compress="lossless"`` took 21 s for the Flux
             transformer against 1.9 s plain): a stack of Flux-double-block-sized Linear layers
             (--capture-blocks) captured plain and coded, wall clock; coding one 3072 x 12288
             tensor on the GPU (``encode_tensor``, from device memory) and through
             ``encode_host`` (host tensor in, host blob out); and a torch.profiler table of one
             coded capture (the top operators by host and by device time).

The streamed step (Flux-dev at minimal VRAM and at half residency, against the bf16 copy bound)
is ``benchmarks/offload.py --model flux --storage bf16,lossless``: the same run times both.

    PYTHONPATH=src python benchmarks/lossless.py                 # the H200 run
    PYTHONPATH=src python benchmarks/lossless.py --parts decode  # the GPU part alone
    PYTHONPATH=src python benchmarks/lossless.py --smoke         # CPU: tiny shapes, no timing

Writes docs/benchmarks/lossless.{json,md} (under $SHUTTLE_BENCH_OUT when set).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from shuttle.kernels.exponent_decode import DECODE_KERNELS, decode_exponents  # noqa: E402
from shuttle.weights.lossless import LosslessTensor  # noqa: E402

GB = 1e9


def _shapes(model: nn.Module) -> Counter:
    """Shape -> how many of the model's parameters have it."""
    out: Counter = Counter()
    for p in model.parameters():
        out[tuple(p.shape)] += 1
    return out


def models(smoke: bool) -> dict[str, Counter]:
    """Parameter shapes of each model, built on meta from its real config."""
    if smoke:
        return {"tiny": Counter({(256, 512): 3, (512,): 2, (64, 96): 1})}
    from diffusers import FluxTransformer2DModel
    from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5EncoderModel

    with torch.device("meta"):
        flux = FluxTransformer2DModel()
        t5 = T5EncoderModel(T5Config(d_model=4096, d_ff=10240, d_kv=64, num_heads=64,
                                     num_layers=24, vocab_size=32128,
                                     feed_forward_proj="gated-gelu"))
        llama = LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                             num_hidden_layers=32, num_attention_heads=32,
                                             num_key_value_heads=8, vocab_size=128256))
    return {"flux_dev_transformer": _shapes(flux), "t5_xxl_encoder": _shapes(t5),
            "llama3_8b": _shapes(llama)}


def weight(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    fan_in = shape[-1] if len(shape) > 1 else 1
    scale = (0.5 + 1.5 * torch.rand((), generator=g).item()) / math.sqrt(fan_in)
    if len(shape) == 1:  # norms and biases: around 1 or 0 in real checkpoints
        return (1.0 + 0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)


def ratio_rows(shapes: dict[str, Counter], sample: int) -> tuple[list[dict], dict]:
    g = torch.Generator().manual_seed(0)
    rows, coded_by_shape = [], {}
    for name, counts in shapes.items():
        raw = coded = 0
        encode_s, encoded_bytes = 0.0, 0
        for shape, n in counts.items():
            key = shape
            if key not in coded_by_shape:
                got = []
                for _ in range(min(sample, n)):
                    w = weight(shape, g)
                    t = time.perf_counter()
                    rep = LosslessTensor.encode_tensor(w)
                    encode_s += time.perf_counter() - t
                    encoded_bytes += w.nbytes
                    if rep is not None:
                        back = rep.decode()
                        if not torch.equal(back.view(torch.int16), w.view(torch.int16)):
                            raise SystemExit(f"{name} {shape}: decode differs from the source")
                    got.append((rep.blob.numel() if rep is not None else w.nbytes) / w.nbytes)
                coded_by_shape[key] = statistics.fmean(got)
            nbytes = math.prod(shape) * 2 * n
            raw += nbytes
            coded += nbytes * coded_by_shape[key]
        rows.append({"model": name, "bf16_gb": raw / GB, "coded_gb": coded / GB,
                     "ratio": coded / raw,
                     "encode_gb_s": encoded_bytes / GB / encode_s if encode_s else None})
    return rows, coded_by_shape


def decode_rows(shape: tuple[int, ...], rounds: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    sources = [weight(shape, g) for _ in range(4)]
    reps = [LosslessTensor.encode_tensor(w) for w in sources]
    blobs = [r.blob.cuda() for r in reps]
    outs = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    parts = [r.parts(b) for r, b in zip(reps, blobs, strict=True)]

    def decode(kernel: str, i: int) -> None:
        p = parts[i % 4]
        decode_exponents(p.words, p.offsets, p.lut, p.raw, p.checks,
                         outs[i % 4].view(-1).view(torch.int16), errors, True, kernel=kernel)

    variants, ratios = {}, {}
    for kernel in DECODE_KERNELS:
        for i, w in enumerate(sources):
            outs[i].fill_(0)
            decode(kernel, i)
            if not torch.equal(outs[i].cpu().view(torch.int16), w.view(torch.int16)) \
                    or errors.item():
                raise SystemExit(f"the {kernel!r} GPU decode differs from the source")
        variants[f"triton_{kernel}"] = functools.partial(decode, kernel)
        ratios[f"triton_{kernel}"] = statistics.fmean(r.ratio for r in reps)
    dense = [w.cuda() for w in sources]
    variants["d2d_copy_bf16"] = lambda i: outs[i % 4].copy_(dense[(i + 1) % 4])
    ratios["d2d_copy_bf16"] = 1.0
    try:  # the other design: nvCOMP's byte-stream codecs on the same bf16 bytes
        from nvidia import nvcomp
    except ImportError as e:
        print(f"nvcomp skipped: {e}")
    else:
        for algo in ("ans", "bitcomp"):
            try:  # each on its own: an API of another version skips only what it breaks
                codec = nvcomp.Codec(algorithm=algo.upper() if algo == "ans" else "Bitcomp")
                enc = [codec.encode(nvcomp.as_array(d.view(torch.uint8).view(-1)))
                       for d in dense]
                ratios[f"nvcomp_{algo}"] = statistics.fmean(
                    e.buffer_size / d.nbytes for e, d in zip(enc, dense, strict=True))
            except Exception as e:  # reported, not fatal
                print(f"nvcomp {algo} skipped: {type(e).__name__}: {e}")
                continue
            variants[f"nvcomp_{algo}"] = (lambda i, codec=codec, enc=enc:
                                          codec.decode(enc[i % 4]))
    times = harness.interleaved(variants, rounds=rounds, warmup=5)
    nbytes = math.prod(shape) * 2
    return [{"variant": k, "median_ms": v["median_ms"],
             "gb_s_out": nbytes / GB / (v["median_ms"] / 1e3),
             "code_ratio": ratios.get(k)} for k, v in times.items()]


def capture_rows(n_blocks: int, smoke: bool) -> tuple[list[dict], str]:
    """Plain and coded captures of a stack of Flux-double-block-sized layers, coding one
    tensor alone, and a profile of one coded capture."""
    from torch.profiler import ProfilerActivity, profile

    from shuttle.offload import ModelOffloader

    d = 64 if smoke else 3072
    shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * 2  # image and text streams

    def build() -> nn.Module:
        g = torch.Generator().manual_seed(0)
        blocks = nn.ModuleList()
        for _ in range(n_blocks):
            block = nn.Module()
            block.layers = nn.ParameterList([nn.Parameter(weight(sh, g), requires_grad=False)
                                             for sh in shapes])
            blocks.append(block)
        root = nn.Module()
        root.blocks = blocks
        return root

    nbytes = n_blocks * sum(2 * a * b for a, b in shapes)
    rows = []
    for what, compress in (("capture, plain", None), ("capture, compress='lossless'",
                                                      "lossless")):
        model = build()
        t = time.perf_counter()
        ModelOffloader.from_module(model, blocks=["blocks"], compress=compress)
        rows.append({"what": what, "s": time.perf_counter() - t})
        del model
    one = weight((4 * d, d), torch.Generator().manual_seed(1))
    if torch.cuda.is_available():
        dev = one.cuda()
        LosslessTensor.encode_tensor(dev)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        LosslessTensor.encode_tensor(dev)
        torch.cuda.synchronize()
        rows.append({"what": f"encode_tensor {tuple(one.shape)} on the GPU",
                     "s": time.perf_counter() - t, "bytes": one.nbytes})
    host = one.pin_memory() if torch.cuda.is_available() else one
    t = time.perf_counter()
    LosslessTensor.encode_host(host)
    rows.append({"what": f"encode_host {tuple(one.shape)} (host in, host out)",
                 "s": time.perf_counter() - t, "bytes": one.nbytes})
    for r in rows:
        r["gb_s"] = r.pop("bytes", nbytes) / GB / r["s"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    model = build()
    with profile(activities=activities) as prof:
        ModelOffloader.from_module(model, blocks=["blocks"], compress="lossless")
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = (prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
             + "\n" + (prof.key_averages().table(sort_by=sort, row_limit=10)
                       if torch.cuda.is_available() else ""))
    return rows, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no timing")
    p.add_argument("--sample", type=int, default=2, help="tensors coded per distinct shape")
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--parts", default="ratio,decode",
                   help="which parts: ratio (CPU coding, minutes at real sizes), decode (GPU), "
                        "capture (GPU: coding at capture, profiled)")
    p.add_argument("--capture-blocks", type=int, default=4)
    args = p.parse_args()
    parts = set(args.parts.split(","))
    table, payload = "", {}
    if "ratio" in parts:
        rows, _ = ratio_rows(models(args.smoke), args.sample)
        table = harness.markdown_table(
            ["model", "bf16 GB", "coded GB", "ratio", "encode GB/s (CPU, one thread per tensor)"],
            [[r["model"], f"{r['bf16_gb']:.2f}", f"{r['coded_gb']:.2f}", f"{r['ratio']:.3f}",
              f"{r['encode_gb_s']:.2f}" if r["encode_gb_s"] else "-"] for r in rows])
        payload["ratio"] = rows
    if "decode" in parts and not args.smoke and torch.cuda.is_available():
        dec = decode_rows((3072, 12288), args.rounds)
        payload["decode"] = dec
        table += ("\n\n" if table else "") + harness.markdown_table(
            ["decoder (3072 x 12288 bf16)", "median ms", "GB/s of bf16 out", "coded / raw"],
            [[r["variant"], f"{r['median_ms']:.3f}", f"{r['gb_s_out']:.0f}",
              "-" if r["code_ratio"] is None else f"{r['code_ratio']:.3f}"] for r in dec])
    if "capture" in parts and (args.smoke or torch.cuda.is_available()):
        cap, profile = capture_rows(2 if args.smoke else args.capture_blocks, args.smoke)
        payload["capture"] = cap
        table += ("\n\n" if table else "") + harness.markdown_table(
            ["what", "seconds", "GB/s of bf16 in"],
            [[r["what"], f"{r['s']:.3f}", f"{r['gb_s']:.2f}"] for r in cap])
        table += "\n\nOne coded capture, profiled:\n\n```\n" + profile + "\n```"
    if args.smoke:
        print(table)
        return
    path = harness.write_results("lossless", payload, table,
                                 "Lossless-coded bf16 weights: ratio and decode throughput")
    print(path.read_text())


if __name__ == "__main__":
    main()
