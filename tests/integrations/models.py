"""Tiny random-weight pipelines and models for the integration tests (no downloads), and a
meter that reports given activations (the CPU has no device memory statistics) with what the
handle tests read of a handle's modules (byte figures from the storages' own layouts)."""

from __future__ import annotations

import contextlib

import torch

import shuttle
from shuttle.integrations.activations import Reading
from shuttle.offload import ModelOffloader, floor_bytes

# Flux's CLIP ids are padded to the tokenizer's max length; 77 as in the real tokenizer.
_WORDS = ["[PAD]", "[UNK]", "</s>", "a", "red", "cat", "blue", "dog"]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(_WORDS)}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="[PAD]", unk_token="[UNK]",
                                   model_max_length=77)


def tiny_flux(head_dim: int = 16, heads: int = 2, axes: tuple[int, int, int] = (4, 4, 8)):
    """A FluxPipeline of random weights: 2 double and 3 single blocks, CLIP, T5, a 1-level VAE;
    the transformer ``heads`` x ``head_dim`` wide (``axes``: its rotary dims, summing to
    ``head_dim``)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=3,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=32,
        pooled_projection_dim=32, axes_dims_rope=list(axes))
    clip = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, hidden_size=32, intermediate_size=37,
        num_attention_heads=4, num_hidden_layers=2, vocab_size=16, projection_dim=32))
    t5 = T5EncoderModel(T5Config(vocab_size=16, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                 num_heads=4, decoder_start_token_id=0))
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,),
        layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    for m in (transformer, clip, t5, vae):
        m.eval()  # built from configs they start in training mode (T5's dropout is on)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=clip,
                        tokenizer=_tokenizer(), text_encoder_2=t5, tokenizer_2=_tokenizer(),
                        transformer=transformer, vae=vae)


def tiny_wan():
    """A WanPipeline of random weights in bfloat16 (2 blocks, UMT5, Wan's VAE): saved and
    loaded with ``torch_dtype=torch.bfloat16``, diffusers keeps the blocks' norms and
    scale-shift tables in float32 beside the bfloat16 files."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=16,
                                        ffn_dim=64, num_layers=2, text_dim=32, freq_dim=32)
    umt5 = UMT5EncoderModel(UMT5Config(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                                       vocab_size=16, feed_forward_proj="gated-gelu"))
    vae = AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    with torch.no_grad():
        for p in transformer.parameters():  # its output layers start at zero
            p.normal_(0, 0.1)
    for m in (transformer, umt5, vae):
        m.eval()
    pipe = WanPipeline(tokenizer=_tokenizer(), text_encoder=umt5, transformer=transformer,
                       vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))
    return pipe.to(torch.bfloat16)


def run_wan(pipe) -> torch.Tensor:
    """Two denoising steps of 5 frames of 32x32, seeded; decoded frames."""
    with torch.no_grad():
        return pipe("a red cat", negative_prompt="blue dog", height=32, width=32, num_frames=5,
                    num_inference_steps=2, max_sequence_length=16, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).frames


def run_flux(pipe, output_type: str = "latent") -> torch.Tensor:
    """Two denoising steps of a 16x16 image, seeded; latents or decoded pixels."""
    with torch.no_grad():
        return pipe("a red cat", num_inference_steps=2, height=16, width=16,
                    max_sequence_length=16, output_type=output_type,
                    generator=torch.Generator().manual_seed(0)).images


def random_lora(shapes: dict[str, tuple[int, int]], rank: int, scale: float, seed: int,
                prefix: str = "") -> shuttle.LoRA:
    """A LoRA of random factors (``lora_A``/``lora_B`` keys) on each ``key -> (out, in)``."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for key, (out_f, in_f) in shapes.items():
        sd[f"{prefix}{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * scale
        sd[f"{prefix}{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * scale
    return shuttle.load_lora(sd)


def flux_lora() -> shuttle.LoRA:
    """Diffusers-style keys on a streamed block, a non-block layer and the CLIP encoder."""
    return random_lora({
        "transformer.single_transformer_blocks.1.attn.to_q": (32, 32),
        "transformer.transformer_blocks.0.ff.net.2": (32, 128),
        "transformer.x_embedder": (32, 4),
        "text_encoder.text_model.encoder.layers.1.self_attn.q_proj": (32, 32),
    }, rank=4, scale=0.3, seed=5)


def tiny_llama():
    """A LlamaForCausalLM of random weights: 3 layers, hidden 32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def llama_lora() -> shuttle.LoRA:
    """PEFT-style keys on two streamed layers and the (non-layer) head."""
    return random_lora({"model.layers.0.self_attn.q_proj": (32, 32),
                        "model.layers.2.mlp.down_proj": (32, 64),
                        "lm_head": (64, 32)}, rank=4, scale=0.3, seed=6,
                       prefix="base_model.model.")


def snapshot(module: torch.nn.Module) -> dict[str, tuple[int, torch.device, torch.Tensor]]:
    """Name -> (identity, device, value copy) of every parameter and buffer."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {n: (id(t), t.device, t.detach().clone()) for n, t in tensors}


def assert_restored(module: torch.nn.Module, before: dict) -> None:
    """Same parameter objects, devices and bits everywhere; no instance attribute left over."""
    params = dict(module.named_parameters())
    after = {**params, **dict(module.named_buffers())}
    assert after.keys() == before.keys()
    for name, (ident, device, value) in before.items():
        t = after[name]
        assert t.device == device and torch.equal(t.detach(), value), name
        assert name not in params or id(t) == ident, f"{name} is a new Parameter"
    for m in module.modules():
        assert not {"forward", "_shuttle_hooks", "_hf_hook", "decode", "encode"} & set(m.__dict__)


def midsize_flux(num_layers: int = 2, num_single_layers: int = 4):
    """A bf16 FluxPipeline whose transformer has Flux-dev's width (3072, 24 heads of 128) and a
    few blocks, beside small CLIP/T5 encoders of the widths it reads (768 pooled, 4096) and a
    one-level VAE with Flux's 16 latent channels. Random weights; for the GPU tests.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
        pooled_projection_dim=768, guidance_embeds=False, axes_dims_rope=[16, 56, 56])
    clip = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, hidden_size=768, intermediate_size=1024,
        num_attention_heads=12, num_hidden_layers=2, vocab_size=16, projection_dim=768))
    t5 = T5EncoderModel(T5Config(vocab_size=16, d_model=4096, d_kv=64, d_ff=1024, num_layers=2,
                                 num_heads=8, decoder_start_token_id=0))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(32,), layers_per_block=1,
        latent_channels=16, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.1159, scaling_factor=0.3611)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=clip,
                        tokenizer=_tokenizer(), text_encoder_2=t5, tokenizer_2=_tokenizer(),
                        transformer=transformer, vae=vae)
    pipe.to(torch.bfloat16)
    for m in (transformer, clip, t5, vae):
        m.eval()
    return pipe


def run_midsize_flux(pipe, device: str = "cuda") -> torch.Tensor:
    """Two denoising steps of a 64x64 image (1024 image tokens), seeded; decoded pixels."""
    with torch.no_grad():
        return pipe("a red cat", num_inference_steps=2, height=64, width=64,
                    max_sequence_length=16, output_type="pt",
                    generator=torch.Generator(device).manual_seed(0)).images


def midsize_flux_lora() -> shuttle.LoRA:
    """Diffusers-style keys on both block lists, a non-block layer and the CLIP encoder."""
    return random_lora({
        "transformer.transformer_blocks.1.attn.to_q": (3072, 3072),
        "transformer.single_transformer_blocks.2.proj_mlp": (12288, 3072),
        "transformer.x_embedder": (3072, 64),
        "text_encoder.text_model.encoder.layers.1.self_attn.q_proj": (768, 768),
    }, rank=8, scale=0.02, seed=8)


def midsize_llama(num_layers: int = 4):
    """A bf16 LlamaForCausalLM with Llama-3.1-8B's layer width (4096, 14336, 32 heads, 8 KV
    heads) and a few layers, a 32000-token vocabulary. Random weights; for the GPU tests.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=num_layers, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=4096,
                         rope_theta=500000.0, tie_word_embeddings=False)
    return LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16).eval()


def midsize_llama_lora() -> shuttle.LoRA:
    """PEFT-style keys on two layers and the (non-layer) head."""
    return random_lora({"model.layers.0.self_attn.q_proj": (4096, 4096),
                        "model.layers.3.mlp.down_proj": (4096, 14336),
                        "lm_head": (32000, 4096)}, rank=8, scale=0.02, seed=9,
                       prefix="base_model.model.")


# -- the handle under a budget, on the CPU ----------------------------------------------------


class FakeMeter:
    """Reports ``peaks[name]`` bytes (a number, or a function of nothing) for each call of
    module ``name`` with ``margin`` bytes, and logs ``(name, sample)`` per call."""

    def __init__(self, peaks: dict | None = None, margin: int = 0):
        self.peaks = peaks or {}
        self.margin = margin
        self.calls: list[tuple[str, bool]] = []

    @contextlib.contextmanager
    def measure(self, name, device, sample):
        self.calls.append((name, sample))
        reading = Reading()
        yield reading
        peak = self.peaks.get(name, 0)
        reading.peak, reading.margin = peak() if callable(peak) else peak, self.margin


def offload(pipe, budget, meter):
    from shuttle.integrations import diffusers as shuttle_diffusers

    return shuttle_diffusers.offload(pipe, max_host_bytes=2**22, vram_budget=budget,
                                     device="cpu", prefetch=1, meter=meter)


def sizes(off: ModelOffloader) -> tuple[int, int]:
    """(floor, everything resident) device weight bytes."""
    s = off.storage
    return floor_bytes(s), s.rest.layout.nbytes + sum(
        u.layout.nbytes for us in s.groups.values() for u in us)


def active(handle) -> set[str]:
    return {n for n, o in handle.offloaders.items() if o.active}


def record(module: torch.nn.Module, what) -> list:
    """The values of ``what()`` at each call of ``module`` (a forward pre-hook)."""
    seen: list = []
    module.register_forward_pre_hook(lambda m, a: seen.append(what()))
    return seen
