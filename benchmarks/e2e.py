"""End to end: a Flux pipeline and a Llama-3.1-8B model offloaded by shuttle, diffusers, accelerate.

Scenarios (--scenario flux | llama | both), random bf16 weights at real size, built on the meta
device and filled from one seeded random pool (norm weights 1, embeddings scaled up so that the
outputs depend on the tokens; nothing downloaded; word-level tokenizers built in place):

    flux    diffusers' FluxPipeline: FluxTransformer2DModel at Flux-dev's config (19 double +
            38 single blocks, guidance embedding; 23.8 GB), T5-XXL encoder (24 layers, 4096 wide;
            9.5 GB), CLIP-L text model (0.25 GB), Flux's VAE (0.17 GB). One call: a fixed
            prompt (T5 ids padded to 512, CLIP to 77), 1024x1024, 4 steps, guidance 3.5, latents
            from a generator seeded on the device, output_type="pt". Output: the pixels and the
            last step's latents.
    llama   LlamaForCausalLM at Llama-3.1-8B's config (32 layers, 4096 wide, 8 KV heads, 128256
            tokens, llama3 rope scaling, untied head; 16.1 GB). One call: model.generate() of 16
            greedy new tokens after a 512-token prompt of fixed random ids, with the KV cache.
            Output: the token ids.

Variants (--variants keeps those starting with the given comma-separated prefixes):

    resident                     everything on the device: the reference output
    shuttle                      shuttle.integrations.{diffusers,transformers}.offload(...,
                                 vram_budget=None, prefetch=2): one component on the device at
                                 a time, the denoiser's (or the LLM's) blocks streamed
    shuttle_<B>GiB               the same with vram_budget=B GiB (--budgets; flux 16,8,4,
                                 llama 8,4): as many blocks resident as fit; with a budget
                                 the text encoders stream too (T5-XXL's blocks, its first
                                 one holding the relative attention bias, share one ring
                                 sized by the largest) and the VAE decodes tiled when its
                                 activations would not fit
    lossless, lossless_<B>GiB    shuttle and shuttle_<B>GiB with compress="lossless": the
                                 bf16 weights held coded in pinned memory (about 0.67x the
                                 bytes), copied coded and decoded on the device
    diffusers_group              (flux) pipe.enable_group_offload(block_level, 1 block per
                                 group, use_stream=True, record_stream=True)
    diffusers_model_cpu_offload  (flux) pipe.enable_model_cpu_offload()
    accelerate_<B>GiB            accelerate infer_auto_device_map(max_memory={0: B GiB, "cpu":
                                 ...}, no_split_module_classes=the block classes) +
                                 dispatch_model(main_device=0); flux: CLIP and the VAE on the
                                 device, the transformer mapped with what is left of B, then the
                                 T5 encoder with what the transformer left over (blocks on the
                                 CPU, loaded per call, when nothing is left)

Each variant runs in its own process (``e2e.py --worker SCENARIO VARIANT``), so that its peak
device memory and peak host RSS are its own: the worker builds the model on the CPU and starts
CUDA (the RSS then is the "baseline"), sets the variant up, makes one warm-up call and --runs
timed calls (flux 3, llama 5), saves its output and prints one JSON line; the driver collects
it, compares the output with the resident one and writes the results after every variant, so
a cut-off run keeps its rows.

Measured per variant: call time (wall clock between device synchronizations, and CUDA events;
medians), for llama new tokens/s (16 / call time, prefill included); peak device memory
(max_memory_allocated and max_memory_reserved from setup to the end); peak host RSS (VmRSS
sampled every 10 ms from setup to the end, and VmHWM after resetting it); setup time; whether
the output is bit-identical to the resident variant's (and whether the variant's own calls all
agree). Every call runs under sdpa_kernel([FLASH_ATTENTION, MATH]): cuDNN attention is
nondeterministic from run to run on Hopper (the resident Llama's own logits differ between
runs from decode step 8), which would make bit-identity meaningless.

    PYTHONPATH=src python benchmarks/e2e.py --scenario both            # the H200 run
    PYTHONPATH=src python benchmarks/e2e.py --scenario both --smoke    # tiny models, minutes
    PYTHONPATH=src python benchmarks/e2e.py --scenario flux --variants shuttle,diffusers \\
        --keep build/e2e    # runs split over several commands share outputs and rows in --keep

Writes docs/benchmarks/<--out, default e2e>.{json,md,png} (under $SHUTTLE_BENCH_OUT when set).
``--device cpu`` runs the same flow on the CPU (debugging the plumbing; most baselines then fail
and report their error).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from offload import GB, GIB, POOL, fill, pinned_bandwidth, rss_bytes  # noqa: E402

ROW_MARK = "E2E_ROW "  # prefix of the worker's result line
SCENARIOS = ("flux", "llama")
BUDGETS = {"flux": "16,8,4", "llama": "8,4"}  # GiB, defaults of --budgets
SHUTTLE = ("shuttle", "lossless")  # the variants shuttle runs (lossless: compress="lossless")
RUNS = {"flux": 3, "llama": 5}  # defaults of --runs
SMOKE_FRACTIONS = (0.75, 0.5)  # --smoke budgets: fractions of the weight bytes
EMBED_SCALE = 50.0  # embeddings: pool values (std 0.02) times this, std 1
PROMPT = "a red cat sitting on a blue chair in the sun next to a small dog"
WORDS = ["[PAD]", "[UNK]", "</s>", *sorted(set(PROMPT.split()))]


# -- arguments --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["flux", "llama", "both"], default="both")
    p.add_argument("--variants", default="",
                   help="comma-separated variant prefixes to run (default: all); the resident "
                        "reference runs too unless its output is in --keep already")
    p.add_argument("--budgets", default="",
                   help="VRAM budgets in GiB for shuttle_<B>GiB and accelerate_<B>GiB, "
                        "comma-separated, for every scenario run (default flux 16,8,4; llama "
                        "8,4; --smoke: 0.75 and 0.5 of the weight bytes)")
    p.add_argument("--runs", type=int, help="timed calls after 1 warm-up (flux 3, llama 5)")
    p.add_argument("--prefetch", type=int, default=2, help="shuttle's blocks loaded ahead")
    p.add_argument("--smoke", action="store_true",
                   help="tiny configs (few narrow blocks, 128x128, 2 steps, short prompts)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu to debug the plumbing")
    p.add_argument("--out", default="e2e", help="results name under docs/benchmarks/")
    p.add_argument("--keep", default="",
                   help="folder for the variants' outputs and the rows, kept across runs: a "
                        "later run with the same folder compares with the resident output kept "
                        "there and reports the earlier rows too (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    p.add_argument("--worker", nargs=2, metavar=("SCENARIO", "VARIANT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def budgets_gib(scenario: str, args: argparse.Namespace) -> list[float]:
    """The VRAM budgets (GiB) of one scenario; under --smoke, fractions of its weight bytes."""
    if args.budgets:
        return [float(x) for x in args.budgets.split(",") if x.strip()]
    if args.smoke:
        total = smoke_bytes(scenario)
        return [float(f"{f * total / GIB:.3g}") for f in SMOKE_FRACTIONS]
    return [float(x) for x in BUDGETS[scenario].split(",")]


def variants(scenario: str, args: argparse.Namespace) -> list[str]:
    """Every variant of ``scenario`` in run order (resident first), before --variants."""
    bs = budgets_gib(scenario, args)
    out = ["resident", *(f"{kind}{suffix}" for kind in SHUTTLE
                         for suffix in ["", *(f"_{b:g}GiB" for b in bs)])]
    if scenario == "flux":
        out += ["diffusers_group", "diffusers_model_cpu_offload"]
    return out + [f"accelerate_{b:g}GiB" for b in bs]


def selected(variant: str, args: argparse.Namespace) -> bool:
    prefixes = [s.strip() for s in args.variants.split(",") if s.strip()]
    return not prefixes or any(variant.startswith(s) for s in prefixes)


def budget_of(variant: str) -> float | None:
    """B of ``shuttle_<B>GiB`` / ``lossless_<B>GiB`` / ``accelerate_<B>GiB``; None for the
    others."""
    tail = variant.rsplit("_", 1)[-1]
    return float(tail[:-3]) if tail.endswith("GiB") else None


# -- models -----------------------------------------------------------------------------------


def make_pool() -> torch.Tensor:
    """The random bf16 values every weight is sliced from (as benchmarks/offload.py, but of an
    odd length: the rows of a wide table, a 128256 x 4096 head, do not repeat every 2**26 values,
    which would make greedy decoding pick among the first 16384 tokens only)."""
    return (torch.randn(POOL - 3, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()


def materialize(make: Callable[[], nn.Module], pool: torch.Tensor, base: int) -> nn.Module:
    """``make()`` built on the meta device, then given bf16 parameters on the CPU.

    Parameters are filled from ``pool`` (tensor ``i`` from offset ``base + i * 1_000_003``);
    norm weights (the ``weight`` of a module whose class name holds "Norm") are 1 and embedding
    tables are scaled by ``EMBED_SCALE``. Buffers are built for real (accelerate's
    ``init_empty_weights`` keeps them off meta: rotary tables, position ids). Each parameter is
    a new ``Parameter`` on the filled tensor, the same one wherever the model ties it, and the
    model holds the only reference: the model is the state, no copy.
    """
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = make()
    norms = {id(p) for m in model.modules() if "Norm" in type(m).__name__
             for n, p in m.named_parameters(recurse=False) if n == "weight"}
    embeds = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    made: dict[int, nn.Parameter] = {}
    for i, (_, meta) in enumerate(model.named_parameters(remove_duplicate=False)):
        if id(meta) in made:
            continue
        t = torch.empty(meta.shape, dtype=torch.bfloat16 if meta.is_floating_point()
                        else meta.dtype)
        if id(meta) in norms:
            t.fill_(1)
        else:
            fill(t, pool, base + i * 1_000_003)
            if id(meta) in embeds:
                t.mul_(EMBED_SCALE)
        made[id(meta)] = nn.Parameter(t, requires_grad=False)
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = made[id(p)]
    return model.eval().requires_grad_(False)


def nbytes(module: nn.Module) -> int:
    unique = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in unique.values())


def tokenizer(max_length: int):
    """A word-level tokenizer of the prompt's words, padding to ``max_length``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="[PAD]", unk_token="[UNK]",
                                   eos_token="</s>", model_max_length=max_length)


# Flux-dev's scheduler config (shifted sigmas by image size).
FLUX_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                      max_shift=1.15, num_train_timesteps=1000, shift=3.0,
                      use_dynamic_shifting=True)
FLUX_CALL = dict(height=1024, width=1024, steps=4, guidance=3.5, max_sequence_length=512)
FLUX_CALL_SMOKE = dict(height=128, width=128, steps=2, guidance=3.5, max_sequence_length=32)
LLAMA_CALL = dict(prompt=512, new=16)
LLAMA_CALL_SMOKE = dict(prompt=32, new=8)


def flux_configs(smoke: bool) -> dict[str, dict]:
    """Constructor arguments of the Flux components (real, or tiny under ``smoke``)."""
    if smoke:
        return {
            "transformer": dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4,
                                attention_head_dim=64, num_attention_heads=4,
                                joint_attention_dim=256, pooled_projection_dim=128,
                                guidance_embeds=True, axes_dims_rope=(8, 28, 28)),
            "text_encoder_2": dict(vocab_size=1024, d_model=256, d_ff=512, num_layers=2,
                                   num_heads=4, d_kv=64, feed_forward_proj="gated-gelu",
                                   dense_act_fn="gelu_new", is_encoder_decoder=False,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
            "text_encoder": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, vocab_size=1024, projection_dim=128,
                                 max_position_embeddings=77, hidden_act="quick_gelu",
                                 bos_token_id=0, eos_token_id=2, pad_token_id=1),
            "vae": dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4,
                        block_out_channels=(32, 32, 64, 64), layers_per_block=1,
                        latent_channels=16, norm_num_groups=32, use_quant_conv=False,
                        use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611),
        }
    return {
        # diffusers' defaults are Flux's shapes; Flux-dev adds the guidance embedding.
        "transformer": dict(guidance_embeds=True),
        # google/t5-v1_1-xxl, the encoder Flux uses
        "text_encoder_2": dict(vocab_size=32128, d_model=4096, d_ff=10240, num_layers=24,
                               num_heads=64, d_kv=64, feed_forward_proj="gated-gelu",
                               dense_act_fn="gelu_new", relative_attention_num_buckets=32,
                               relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
                               is_encoder_decoder=False, tie_word_embeddings=False,
                               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
        # openai/clip-vit-large-patch14's text model (its legacy token ids: eos 2)
        "text_encoder": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                             num_attention_heads=12, vocab_size=49408, projection_dim=768,
                             max_position_embeddings=77, hidden_act="quick_gelu",
                             layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=2,
                             pad_token_id=1),
        "vae": dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                    up_block_types=("UpDecoderBlock2D",) * 4,
                    block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                    latent_channels=16, norm_num_groups=32, sample_size=1024,
                    use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159,
                    scaling_factor=0.3611),
    }


def llama_config(smoke: bool) -> dict:
    """LlamaConfig arguments: Llama-3.1-8B's (or tiny ones under ``smoke``)."""
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=8192)
    common = dict(rope_parameters=rope, hidden_act="silu", rms_norm_eps=1e-5,
                  tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                  bos_token_id=128000, eos_token_id=128001)
    if smoke:
        return dict(common, vocab_size=1024, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=131072, bos_token_id=1000, eos_token_id=1001)
    return dict(common, vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=131072)


def flux_makers(smoke: bool) -> dict[str, Callable[[], nn.Module]]:
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    cfg = flux_configs(smoke)
    return {
        "transformer": lambda: FluxTransformer2DModel(**cfg["transformer"]),
        "text_encoder_2": lambda: tied_t5(T5EncoderModel(T5Config(**cfg["text_encoder_2"]))),
        "text_encoder": lambda: CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"])),
        "vae": lambda: AutoencoderKL(**cfg["vae"]),
    }


def tied_t5(model: nn.Module) -> nn.Module:
    """The encoder reading the shared embedding table (one 263 MB table at real size, as T5's
    checkpoints hold; transformers 5 ties it only when loading from a checkpoint)."""
    model.encoder.embed_tokens = model.shared
    return model


def llama_maker(smoke: bool) -> Callable[[], nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    return lambda: LlamaForCausalLM(LlamaConfig(**llama_config(smoke)))


def build_flux(smoke: bool, pool: torch.Tensor):
    """The FluxPipeline, every component on the CPU in bf16."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    parts = {name: materialize(make, pool, 7_919_993 * k)
             for k, (name, make) in enumerate(flux_makers(smoke).items())}
    call = FLUX_CALL_SMOKE if smoke else FLUX_CALL
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
                        tokenizer=tokenizer(77),
                        tokenizer_2=tokenizer(call["max_sequence_length"]), **parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_llama(smoke: bool, pool: torch.Tensor):
    return materialize(llama_maker(smoke), pool, 0)


def components(scenario: str, target) -> dict[str, nn.Module]:
    if scenario == "flux":
        return {n: m for n, m in target.components.items() if isinstance(m, nn.Module)}
    return {"model": target}


def meta_sizes(scenario: str, smoke: bool) -> dict[str, int]:
    """Weight bytes per component in bf16, from skeletons on the meta device."""
    from accelerate import init_empty_weights

    makers = flux_makers(smoke) if scenario == "flux" else {"model": llama_maker(smoke)}
    out = {}
    for name, make in makers.items():
        with init_empty_weights():
            m = make()
        params = {id(p): p for p in m.parameters()}.values()
        out[name] = sum(p.numel() * 2 for p in params) + sum(
            b.numel() * b.element_size() for b in m.buffers())
    return out


@functools.cache
def smoke_bytes(scenario: str) -> int:
    return sum(meta_sizes(scenario, smoke=True).values())


# -- calls ------------------------------------------------------------------------------------


def flux_call(pipe, device: torch.device, smoke: bool,
              steps: int | None = None) -> Callable[[], dict]:
    """One pipeline call (``steps``: denoising steps other than the scenario's)."""
    c = FLUX_CALL_SMOKE if smoke else FLUX_CALL
    if steps is not None:
        c = {**c, "steps": steps}
    last = c["steps"] - 1

    def call() -> dict:
        kept = {}

        def keep_latents(_pipe, i: int, _t, kwargs: dict) -> dict:
            if i == last:
                kept["latents"] = kwargs["latents"].clone()
            return kwargs

        g = torch.Generator(device).manual_seed(0)
        with torch.no_grad():
            pixels = pipe(PROMPT, height=c["height"], width=c["width"],
                          num_inference_steps=c["steps"], guidance_scale=c["guidance"],
                          max_sequence_length=c["max_sequence_length"], generator=g,
                          output_type="pt", callback_on_step_end=keep_latents,
                          callback_on_step_end_tensor_inputs=["latents"]).images
        return {"pixels": pixels, "latents": kept["latents"]}

    return call


def llama_call(model, device: torch.device, smoke: bool) -> Callable[[], dict]:
    c = LLAMA_CALL_SMOKE if smoke else LLAMA_CALL
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, c["prompt"]), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    mask = torch.ones_like(ids)

    def call() -> dict:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=c["new"],
                                 min_new_tokens=c["new"], do_sample=False, use_cache=True,
                                 pad_token_id=0)
        return {"tokens": out}

    return call


def output_stats(scenario: str, out: dict, smoke: bool) -> dict:
    """A few numbers that show whether the output is degenerate."""
    if scenario == "llama":
        new = out["tokens"][0, -(LLAMA_CALL_SMOKE if smoke else LLAMA_CALL)["new"]:].tolist()
        return {"new_tokens": new, "distinct_new_tokens": len(set(new))}
    px = out["pixels"].float()
    lat = out["latents"].float()
    return {"pixel_mean": px.mean().item(), "pixel_std": px.std().item(),
            "pixels_clamped": ((px == 0) | (px == 1)).float().mean().item(),
            "pixels_nan": int(px.isnan().sum()), "latent_std": lat.std().item(),
            "latents_nan": int(lat.isnan().sum())}


def same_bits(a: dict, b: dict) -> bool:
    """Bitwise equality of two outputs (NaN included), key by key."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k].detach().cpu(), b[k].detach().cpu()
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            return False
    return True


# -- variants ---------------------------------------------------------------------------------


def setup_variant(scenario: str, variant: str, target, device: torch.device,
                  args: argparse.Namespace) -> dict:
    """Put ``target`` (pipeline or model, on the CPU) under ``variant``; returns row fields.

    Whatever the variant needs alive (a shuttle handle) is kept in the returned ``"_keep"``.
    """
    parts = components(scenario, target)
    weight_bytes = sum(nbytes(m) for m in parts.values())
    if variant == "resident":
        target.to(device)
        return {}
    if variant.startswith(SHUTTLE):
        budget = budget_of(variant)
        vram = None if budget is None else int(budget * GIB)
        host = int(1.5 * weight_bytes) + GIB  # a cap for shuttle's cache, not an allocation
        if scenario == "flux":
            from shuttle.integrations import diffusers as integration
        else:
            from shuttle.integrations import transformers as integration
        compress = "lossless" if variant.startswith("lossless") else None
        handle = integration.offload(target, max_host_bytes=host, vram_budget=vram,
                                     device=device, prefetch=args.prefetch, compress=compress)
        return {"_keep": handle, "max_host_bytes": host, "vram_budget": vram,
                "compress": compress}
    if variant == "diffusers_group":
        kw = dict(onload_device=device, offload_device=torch.device("cpu"),
                  offload_type="block_level", num_blocks_per_group=1, use_stream=True,
                  record_stream=True)
        target.enable_group_offload(**kw)
        return {"group_offload": {k: str(v) for k, v in kw.items()}}
    if variant == "diffusers_model_cpu_offload":
        target.enable_model_cpu_offload(device=device)
        return {}
    if variant.startswith("accelerate"):
        return setup_accelerate(scenario, target, device, int(budget_of(variant) * GIB))
    raise ValueError(f"unknown variant {variant!r}")


def dispatch(module: nn.Module, gpu_bytes: int, device: torch.device) -> dict:
    """accelerate: map ``module`` onto the device within ``gpu_bytes`` (the rest on the CPU,
    loaded per forward) and dispatch it; returns a summary of the map."""
    from accelerate import dispatch_model, infer_auto_device_map

    index = device.index or 0
    no_split = list(getattr(module, "_no_split_modules", None) or [])
    kw = dict(max_memory={index: max(gpu_bytes, 0), "cpu": 2**40},
              no_split_module_classes=no_split)
    dmap = infer_auto_device_map(module, **kw)
    on_cpu_only = set(dmap.values()) <= {"cpu", "disk"}
    if on_cpu_only:  # not {"": "cpu"}: dispatch_model keys its CPU weights by module name
        dmap = infer_auto_device_map(module, clean_result=False, **kw)
    placed = {"cpu": 0, "gpu": 0}
    for n, p in module.named_parameters():  # each tensor once, under its map entry
        dev = next(d for k, d in dmap.items() if not k or n == k or n.startswith(k + "."))
        placed["cpu" if dev in ("cpu", "disk") else "gpu"] += p.numel() * p.element_size()
    dispatch_model(module, dmap, main_device=index, force_hooks=on_cpu_only)
    return {"max_memory_gpu": gpu_bytes, "no_split": no_split, "gpu_bytes": placed["gpu"],
            "cpu_bytes": placed["cpu"], "entries": len(dmap)}


def setup_accelerate(scenario: str, target, device: torch.device, budget: int) -> dict:
    if scenario == "llama":
        return {"device_map": {"model": dispatch(target, budget, device)}}
    # Flux: the small components on the device, the transformer (called every step) gets
    # what is left of the budget, the T5 encoder (called once) what the transformer leaves.
    target.text_encoder.to(device)
    target.vae.to(device)
    maps = {}
    tr = target.transformer
    maps["transformer"] = dispatch(tr, budget - torch.cuda.memory_allocated(device), device)
    blocks = [*tr.transformer_blocks, *tr.single_transformer_blocks]
    onload = max(nbytes(b) for b in blocks)  # room for the transformer's offloaded blocks
    left = budget - torch.cuda.memory_allocated(device) - onload
    maps["text_encoder_2"] = dispatch(target.text_encoder_2, left, device)
    return {"device_map": maps}


# -- the worker -------------------------------------------------------------------------------


def _status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Peak VmRSS of this process, sampled every ``interval`` seconds in a thread."""

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(call: Callable[[], dict], device: torch.device) -> tuple[dict, float, float]:
    """(output, wall seconds between synchronizations, CUDA-event seconds) of one call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = device.type == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(device)
    t0 = time.perf_counter()
    if cuda:
        start.record()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        out = call()
    if cuda:
        end.record()
    sync(device)
    wall = time.perf_counter() - t0
    return out, wall, start.elapsed_time(end) / 1e3 if cuda else wall


def worker(args: argparse.Namespace) -> None:
    """Build, set up, time one variant; print its row as one JSON line after ``ROW_MARK``."""
    scenario, variant = args.worker
    if scenario == "probe":  # pinned bandwidth, in a process of its own
        print(ROW_MARK + json.dumps({"pinned_gbs": pinned_bandwidth(),
                                     "env": harness.environment()}), flush=True)
        return
    device = torch.device(args.device)
    if variant.startswith(SHUTTLE):  # its activations and residency decisions
        logging.basicConfig(format="    %(name)s: %(message)s")
        logging.getLogger("shuttle").setLevel(logging.INFO)
    runs = args.runs if args.runs is not None else RUNS[scenario]
    row: dict = {"scenario": scenario, "variant": variant, "smoke": args.smoke, "runs": runs}
    keep: list = []
    try:
        t0 = time.perf_counter()
        pool = make_pool()
        target = (build_flux if scenario == "flux" else build_llama)(args.smoke, pool)
        del pool
        gc.collect()
        row["build_s"] = time.perf_counter() - t0
        row["weight_bytes"] = {n: nbytes(m) for n, m in components(scenario, target).items()}
        print(f"[{scenario}] {variant}: built {sum(row['weight_bytes'].values()) / GB:.2f} GB "
              f"in {row['build_s']:.1f} s", flush=True)
        if device.type == "cuda":  # the CUDA context's host memory counts in the baseline
            torch.empty(1, device=device)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        row["rss_baseline_gb"] = rss_bytes() / GB
        hwm = reset_hwm()
        rss = RssSampler()
        try:
            with rss:
                measure(scenario, variant, target, device, args, runs, row, keep)
        finally:  # also for a variant that failed part way
            if device.type == "cuda":
                row["peak_vram_alloc_gib"] = torch.cuda.max_memory_allocated(device) / GIB
                row["peak_vram_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
            row["rss_peak_gb"] = rss.peak / GB
            row["rss_hwm_gb"] = _status_bytes("VmHWM") / GB if hwm else None
    except Exception as e:  # the row says what failed; the driver goes on with the next one
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {e}"
    print(ROW_MARK + json.dumps(row, default=str), flush=True)


def measure(scenario: str, variant: str, target, device: torch.device,
            args: argparse.Namespace, runs: int, row: dict, keep: list) -> None:
    """Set up, warm up, time ``runs`` calls; fills ``row``; saves the output for the driver."""
    t0 = time.perf_counter()
    extra = setup_variant(scenario, variant, target, device, args)
    sync(device)
    row["setup_s"] = time.perf_counter() - t0
    keep.append(extra.pop("_keep", None))  # alive until the worker ends
    row.update(extra)
    if device.type == "cuda":
        row["vram_after_setup_gib"] = torch.cuda.memory_allocated(device) / GIB
    call = (flux_call if scenario == "flux" else llama_call)(target, device, args.smoke)
    first, wall, _ = timed_call(call, device)
    first = {k: v.detach().cpu() for k, v in first.items()}
    row["warmup_s"] = wall
    print(f"[{scenario}] {variant}: setup {row['setup_s']:.1f} s, warm-up call {wall:.2f} s",
          flush=True)
    walls, events, same = [], [], True
    for _ in range(runs):
        out, wall, ev = timed_call(call, device)
        walls.append(wall)
        events.append(ev)
        same = same and same_bits({k: v.cpu() for k, v in out.items()}, first)
        del out
    handle = keep[-1]
    if handle is not None:  # shuttle: the plans of the modules active after the last call
        row["shuttle_plans"] = {
            name: {"resident": {g: len(r) for g, r in off.plan.resident.items()},
                   "ring": off.plan.ring, "prefetch": off.plan.prefetch,
                   "device_gib": off.plan.device_bytes / GIB}
            for name, off in handle.offloaders.items() if off.plan is not None}
    row.update(call_s=statistics.median(walls), call_s_min=min(walls), call_s_max=max(walls),
               event_s=statistics.median(events), calls_s=walls, deterministic=same,
               output=output_stats(scenario, first, args.smoke))
    if scenario == "llama":
        new = (LLAMA_CALL_SMOKE if args.smoke else LLAMA_CALL)["new"]
        row["tokens_per_s"] = new / row["call_s"]
    torch.save(first, Path(args.keep) / f"{label(scenario, args.smoke)}_{variant}.pt")
    print(f"[{scenario}] {variant}: call {row['call_s']:.3f} s (median of {runs})", flush=True)


# -- the driver -------------------------------------------------------------------------------


def label(scenario: str, smoke: bool) -> str:
    return f"{scenario}_smoke" if smoke else scenario


def run_worker(scenario: str, variant: str, args: argparse.Namespace, keep: Path) -> dict:
    """Run one variant in a child process; returns its row (an error row if it gave none)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", scenario, variant,
           "--device", args.device, "--prefetch", str(args.prefetch), "--keep", str(keep)]
    if args.runs is not None:
        cmd += ["--runs", str(args.runs)]
    if args.smoke:
        cmd.append("--smoke")
    env = dict(os.environ)
    src = str(harness.ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    row, tail = None, []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, bufsize=1) as proc:
        timer = threading.Timer(args.timeout, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                if line.startswith(ROW_MARK):
                    row = json.loads(line[len(ROW_MARK):])
                    continue
                print("    " + line, end="", flush=True)
                tail = (tail + [line.rstrip()])[-30:]
        finally:
            timer.cancel()
        rc = proc.wait()
    if row is None:
        row = {"scenario": scenario, "variant": variant, "smoke": args.smoke,
               "error": f"worker exited {rc} without a row: " + " | ".join(tail[-5:])}
    row["worker_rc"] = rc
    row["wall_s"] = time.perf_counter() - t0
    return row


def compare(row: dict, keep: Path) -> None:
    """Set ``row["bit_identical"]``: its output against the resident one kept in ``keep``."""
    name = label(row["scenario"], row["smoke"])
    mine, ref = keep / f"{name}_{row['variant']}.pt", keep / f"{name}_resident.pt"
    if "error" in row or not mine.exists() or not ref.exists():
        row["bit_identical"] = None
        return
    a, b = torch.load(mine), torch.load(ref)
    row["bit_identical"] = same_bits(a, b)
    row["identical_parts"] = {k: same_bits({k: a[k]}, {k: b[k]}) for k in a if k in b}


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def nearest_shuttle(row: dict, rows: list[dict]) -> dict | None:
    """The shuttle row (uncoded) of the same scenario whose peak VRAM is nearest ``row``'s."""
    vram = row.get("peak_vram_alloc_gib")
    cands = [r for r in rows if r["label"] == row["label"] and r["variant"].startswith("shuttle")
             and "call_s" in r and r.get("peak_vram_alloc_gib") is not None]
    if vram is None or not cands:
        return None
    return min(cands, key=lambda r: abs(r["peak_vram_alloc_gib"] - vram))


HEADERS = ["variant", "call s", "new tokens/s", "peak VRAM GiB (alloc / reserved)",
           "peak host RSS GB (before setup)", "setup s", "bit-identical",
           "call time vs shuttle at nearest VRAM"]


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if "call_s" not in r:
            out.append([r["variant"], f"error: {r.get('error', '?')[:160]}"]
                       + [""] * (len(HEADERS) - 2))
            continue
        ident = ("reference" if r["variant"] == "resident" else
                 {True: "yes", False: "**no**", None: "-"}[r.get("bit_identical")])
        if r.get("deterministic") is False:
            ident += " (own runs differ)"
        # lossless rows are compared with plain shuttle too: what coding buys at that VRAM
        near = None if r["variant"].startswith("shuttle") else nearest_shuttle(r, rows)
        ratio = "-" if near is None else (
            f"{r['call_s'] / near['call_s']:.2f}x ({near['variant']})")
        vram = (f"{r['peak_vram_alloc_gib']:.2f} / {r['peak_vram_reserved_gib']:.2f}"
                if r.get("peak_vram_alloc_gib") is not None else "-")
        out.append([r["variant"], f"{r['call_s']:.3f}", fmt(r.get("tokens_per_s"), ".1f"),
                    vram, f"{r['rss_peak_gb']:.1f} ({r['rss_baseline_gb']:.1f})",
                    f"{r['setup_s']:.1f}", ident, ratio])
    return harness.markdown_table(HEADERS, out)


FAMILIES = {"resident": ("*", "black"), "shuttle": ("o", "tab:blue"),
            "lossless": ("D", "tab:purple"),
            "diffusers": ("s", "tab:orange"), "accelerate": ("^", "tab:green")}


def plot(rows: list[dict], path: Path) -> None:
    """Call time (log) against peak VRAM, one panel per scenario, each variant labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(1, max(len(names), 1), figsize=(7 * max(len(names), 1), 5),
                             squeeze=False)
    for ax, name in zip(axes[0], names, strict=False):
        seen = set()
        for r in rows:
            if r["label"] != name or "call_s" not in r or r.get("peak_vram_alloc_gib") is None:
                continue
            family = r["variant"].split("_")[0]
            marker, color = FAMILIES.get(family, ("x", "tab:red"))
            ax.scatter(r["peak_vram_alloc_gib"], r["call_s"], marker=marker, color=color,
                       s=160 if family == "resident" else 50, zorder=3,
                       label=None if family in seen else family)
            seen.add(family)
            ax.annotate(r["variant"], (r["peak_vram_alloc_gib"], r["call_s"]),
                        textcoords="offset points", xytext=(5, 4), fontsize=8)
        harness.time_axes(ax, "peak VRAM allocated (GiB)", "call time (s, log)", name)
        if seen:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class Report:
    """Rows of every scenario, written out (json, md, png) after each variant.

    With ``--keep`` the rows also live in ``<keep>/rows_<out>.json``, so that runs split over
    several commands report together (a variant run again replaces its row).
    """

    def __init__(self, args: argparse.Namespace, keep: Path | None):
        self.args = args
        self.store = keep / f"rows_{args.out}.json" if keep is not None else None
        self.rows: list[dict] = []
        self.probe: dict = {}
        if self.store is not None and self.store.exists():
            saved = json.loads(self.store.read_text())
            self.rows, self.probe = saved["rows"], saved.get("probe", {})

    def add(self, row: dict) -> None:
        row["label"] = label(row["scenario"], row.get("smoke", False))
        self.rows = [r for r in self.rows
                     if (r["label"], r["variant"]) != (row["label"], row["variant"])]
        self.rows.append(row)
        order = {(s, v): i for s in SCENARIOS for i, v in enumerate(variants(s, self.args))}
        self.rows.sort(key=lambda r: (r["label"], order.get((r["scenario"], r["variant"]), 99),
                                      r["variant"]))
        keys = ("call_s", "tokens_per_s", "peak_vram_alloc_gib", "rss_peak_gb", "setup_s",
                "bit_identical", "error")
        print(f"[{row['scenario']}] {row['variant']}: "
              + ", ".join(f"{k}={row[k]!r}" for k in keys if k in row), flush=True)
        self.write()

    def notes(self) -> str:
        lines = []
        if self.probe.get("pinned_gbs"):
            lines.append(f"Pinned host->device bandwidth: {self.probe['pinned_gbs']:.1f} GB/s "
                         "(one 2 GiB copy, median of 10).")
        for name in dict.fromkeys(r["label"] for r in self.rows):
            sized = [r for r in self.rows if r["label"] == name and "weight_bytes" in r]
            if sized:
                w = sized[0]["weight_bytes"]
                parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in w.items())
                lines.append(f"{name}: weights {sum(w.values()) / GB:.2f} GB ({parts}); "
                             f"{sized[0]['runs']} timed calls per variant after 1 warm-up.")
            for r in self.rows:
                if r["label"] == name and "output" in r and r["variant"] == "resident":
                    lines.append(f"{name}: resident output {json.dumps(r['output'])}.")
        smoke = any(r.get("smoke") for r in self.rows)
        lines += [
            "",
            "Each variant runs in its own process: the model is built on the CPU (random bf16 "
            "weights from one seeded pool: norms 1, embeddings scaled to std 1), then set up "
            "and called. Calls: flux is one FluxPipeline call "
            + ("(smoke: 128x128, 2 steps, T5 ids padded to 32)" if smoke else
               "(1024x1024, 4 steps, guidance 3.5, T5 ids padded to 512, CLIP to 77)")
            + ", output_type='pt'; llama is one generate() of "
            + ("8 greedy tokens after 32 (smoke)" if smoke else
               "16 greedy new tokens after a 512-token prompt")
            + ", KV cache on. call s: median wall clock between device synchronizations "
            "(the CUDA-event times are in the json). new tokens/s: new tokens / call s "
            "(prefill included). Peak VRAM: torch.cuda.max_memory_allocated / "
            "max_memory_reserved from the start of setup to the end. Peak host RSS: VmRSS "
            "sampled every 10 ms from setup to the end (pinned memory counts; VmHWM after a "
            "reset in the json); in parentheses the RSS just before setup, which holds the "
            "built model (the host copy every variant starts from) and the CUDA context. "
            "setup s: from the model on the CPU to ready (shuttle: capture and pinning; "
            "accelerate: mapping and dispatch). bit-identical: the output (flux: pixels and "
            "the last step's latents; llama: the token ids) equals the resident variant's bit "
            "for bit; '(own runs differ)' where the variant's timed calls did not all equal "
            "its warm-up call. Call time vs shuttle: over the shuttle variant whose peak VRAM "
            "is nearest.",
            "",
            "Every call runs under sdpa_kernel([FLASH_ATTENTION, MATH]): PyTorch's cuDNN "
            "attention, which it prefers on Hopper for many of these shapes, is "
            "nondeterministic from run to run (the resident Llama's own logits differ between "
            "runs from decode step 8), which would make bit-identity meaningless.",
            "",
            "shuttle: max_host_bytes 1.5x the weight bytes + 1 GiB (a cap, not an allocation), "
            f"prefetch {self.args.prefetch}; the transformer (or the Llama's layers) streams; "
            "without a budget the other components move whole, with one the text encoders "
            "stream too (T5-XXL's blocks in one ring sized by its largest, the first, which "
            "holds the relative attention bias) and the VAE decodes tiled where its "
            "activations would not fit. lossless: the same with compress='lossless' (the "
            "bf16 weights coded in pinned memory, decoded on the device as they land). "
            "Call time vs shuttle compares it with the uncoded shuttle row of nearest peak "
            "VRAM. diffusers_group: the "
            "pipeline-level enable_group_offload; the transformers text encoders have no "
            "top-level block list, so diffusers moves them whole. accelerate (flux): CLIP and "
            "the VAE on the device; the transformer mapped into the budget minus what is "
            "allocated; T5 into what is left after the transformer's resident part and room "
            "for one of its offloaded blocks (its blocks on the CPU when nothing is left); "
            "offloaded modules are copied from pageable memory at each forward.",
        ]
        return "\n".join(lines)

    def write(self) -> None:
        if self.store is not None:
            self.store.write_text(json.dumps({"rows": self.rows, "probe": self.probe},
                                             default=str))
        tables = []
        for name in dict.fromkeys(r["label"] for r in self.rows):
            tables.append(f"## {name}\n\n" + table([r for r in self.rows if r["label"] == name]))
        png = harness.OUT_DIR / f"{self.args.out}.png"
        notes = f"![call time against peak VRAM]({png.name})\n\n{self.notes()}"
        payload = {"args": {k: v for k, v in vars(self.args).items() if k != "worker"},
                   "probe": self.probe, "rows": self.rows}
        harness.write_results(self.args.out, payload, "\n\n".join(tables),
                              "End to end: Flux and Llama offloaded by shuttle, diffusers and "
                              "accelerate", notes=notes)
        try:
            plot(self.rows, png)
        except Exception as e:  # a broken plot costs the png only
            print(f"plot failed: {type(e).__name__}: {e}", flush=True)


def remove_folder(folder: Path) -> None:
    for p in folder.glob("*.pt"):
        p.unlink()
    folder.rmdir()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("benchmarks/e2e.py needs a CUDA device (or --device cpu to debug)")
    try:
        import accelerate  # noqa: F401
        import diffusers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/e2e.py needs diffusers, transformers and accelerate")
    scenarios = list(SCENARIOS) if args.scenario == "both" else [args.scenario]
    keep = Path(args.keep) if args.keep else None
    folder = keep or Path(tempfile.mkdtemp(prefix="shuttle_e2e_"))
    folder.mkdir(parents=True, exist_ok=True)
    report = Report(args, keep)
    with contextlib.ExitStack() as stack:
        if keep is None:
            stack.callback(remove_folder, folder)
        if args.device.startswith("cuda") and not report.probe:
            probe = run_worker("probe", "bandwidth", args, folder)
            report.probe = {k: probe.get(k) for k in ("pinned_gbs", "env", "error")}
            print(f"pinned host->device: {probe.get('pinned_gbs')} GB/s", flush=True)
        for scenario in scenarios:
            ref = folder / f"{label(scenario, args.smoke)}_resident.pt"
            for variant in variants(scenario, args):
                wanted = selected(variant, args) or (variant == "resident" and not ref.exists())
                if not wanted:
                    continue
                print(f"[{scenario}] {variant} ...", flush=True)
                row = run_worker(scenario, variant, args, folder)
                compare(row, folder)
                report.add(row)
    print(f"wrote {harness.OUT_DIR / args.out}.{{json,md,png}}", flush=True)


if __name__ == "__main__":
    main()
