"""Train a LoRA with shuttle.train, save it as PEFT and kohya files, load it back, merge it.

Two models, random data, a few AdamW steps each, on the CPU in seconds (``--device cuda`` for a
GPU): a small causal LM built from a transformers Llama config, and a Flux-shaped DiT built from
a diffusers config. For each: PEFT's LoRA, ``shuttle.train.accelerate``, train; then the adapter
is written in PEFT's and kohya's spelling, read back with ``shuttle.load_lora``, merged into a
copy of the base model with ``shuttle.merge_lora``, and the merged model is checked against the
trained one on the same inputs.

    python examples/train_lora.py [--steps 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch

import shuttle
import shuttle.train


def llama(device: str) -> tuple[torch.nn.Module, list[str], tuple]:
    """A 2-layer Llama from a config, its LoRA targets, and (loss, output) on fixed tokens."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    ids = torch.randint(0, 128, (4, 32), device=device)

    def loss(m):
        return m(input_ids=ids, labels=ids).loss

    def output(m):
        return m(input_ids=ids).logits

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return model, targets, (loss, output)


def flux_dit(device: str) -> tuple[torch.nn.Module, list[str], tuple]:
    """A Flux-shaped DiT from a config, its LoRA targets, and (loss, output) on fixed inputs."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8]).to(device)
    n_img, n_txt = 64, 8
    inputs = dict(
        hidden_states=torch.randn(2, n_img, 4, device=device),
        encoder_hidden_states=torch.randn(2, n_txt, 32, device=device),
        pooled_projections=torch.randn(2, 32, device=device),
        timestep=torch.tensor([0.5, 0.25], device=device),
        img_ids=torch.zeros(n_img, 3, device=device),
        txt_ids=torch.zeros(n_txt, 3, device=device))
    target = torch.randn(2, n_img, 4, device=device)

    def output(m):
        return m(**inputs).sample

    def loss(m):
        return torch.nn.functional.mse_loss(output(m), target)

    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
               "to_add_out", "ff.net.0.proj", "ff.net.2", "proj_mlp", "proj_out"]
    return model, targets, (loss, output)


def train(name: str, make, steps: int, device: str, out_dir: Path) -> float:
    """Train, save, reload, merge; return the merged model's max relative difference."""
    import peft

    torch.manual_seed(0)
    base, targets, (loss_of, output_of) = make(device)
    frozen = copy.deepcopy(base)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16,
                                                      target_modules=targets))
    report = shuttle.train.accelerate(model)
    print(f"{name}: {report.summary()}")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        opt.step()
        print(f"{name}: step {step} loss {loss.item():.4f}")
    shuttle.train.restore(model)

    peft_dir = out_dir / f"{name}-peft"
    model.save_pretrained(peft_dir)  # PEFT's own files
    lora = shuttle.load_lora(peft_dir)
    kohya = shuttle.save_lora(lora, out_dir / f"{name}-kohya.safetensors", to="kohya")
    merged_error = 0.0
    with torch.no_grad():
        trained = output_of(model)
        for source in (peft_dir, kohya):
            merged = copy.deepcopy(frozen)
            shuttle.merge_lora(merged, [(shuttle.load_lora(source), 1.0)], strict=True)
            diff = (output_of(merged) - trained).abs().max() / trained.abs().max()
            merged_error = max(merged_error, diff.item())
            print(f"{name}: merged from {Path(source).name}: max relative difference "
                  f"{diff.item():.2e}")
    return merged_error


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run both; return each model's merged-vs-trained max relative difference."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        return {name: train(name, make, args.steps, args.device, Path(tmp))
                for name, make in (("llama", llama), ("flux-dit", flux_dit))}


if __name__ == "__main__":
    main()
