"""Serve a model with adapters applied at forward time: attach, change strengths, swap, detach.

A small transformer-shaped stack of Linear layers gets two LoRAs written by PEFT. They are
attached dynamically (the weights are never written), with the default ``quality="auto"``: on a
CUDA device each layer shape's first call times lossless against the fused kernels and later calls
run the fastest (printed below); on the CPU it is the lossless tier. Then strengths change in
place, one adapter is swapped for another of the same targets, and detaching gives back the model
bit for bit.

    python examples/dynamic_adapters.py [--device cuda] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn

import shuttle
from shuttle.apply.tier import TIERS


class Block(nn.Module):
    """Attention-shaped projections and an MLP (the layers a LoRA usually targets)."""

    def __init__(self, dim: int):
        super().__init__()
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.to_out = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        x = x + self.to_out(q * torch.sigmoid(k) + v)
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def peft_adapter(model: nn.Module, rank: int, seed: int, folder: Path) -> Path:
    """A LoRA on every projection, written by PEFT itself (random, non-zero factors)."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                             target_modules=["to_qkv", "to_out", "up", "down"])
    wrapped = peft.get_peft_model(_copy(model), config)
    wrapped.save_pretrained(folder)
    return folder / "adapter_model.safetensors"


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the example; return the largest differences it checks (all should be 0 or tiny)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = nn.Sequential(Block(args.dim), Block(args.dim)).to(args.device, dtype).eval()
    x = torch.randn(1, args.tokens, args.dim, device=args.device, dtype=dtype)
    checks: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        style = peft_adapter(model.cpu(), 16, 1, Path(tmp) / "style")
        detail = peft_adapter(model, 16, 2, Path(tmp) / "detail")
        other = peft_adapter(model, 16, 3, Path(tmp) / "other")
        model.to(args.device)
        base = model(x)
        with shuttle.apply_lora(model, [(style, 0.8)], mode="merge"):
            merged = model(x)  # the first adapter merged (into weights, restored on exit)

        handle = shuttle.attach_lora(model, [(style, 0.8), (detail, 0.5)], max_rank=16,
                                     names=["style", "detail"])
        both = model(x)
        print(f"attached {handle.names} (quality={handle.quality!r}): output moved by "
              f"{float((both - base).abs().max()):.3g}")
        for key, choice in TIERS.choices.items():
            print(f"  {key.rows:>6} x {key.k:>5} -> {key.n:<5} rank {key.r:<3}: eager "
                  f"{choice.best(False)}, CUDA graphs {choice.best(True)}")

        handle.set_strength("detail", 0.0)  # in place: a compiled model does not recompile
        style_only = model(x)
        checks["dynamic vs merged"] = float((style_only - merged).abs().max())

        handle.swap("style", shuttle.load_lora(other))  # same targets and rank: copied in place
        swapped = model(x)
        checks["swap changed the output"] = float((swapped - style_only).abs().max())

        handle.detach()
        checks["detached vs base"] = float((model(x) - base).abs().max())
    for name, value in checks.items():
        print(f"{name}: max abs difference {value:.3g}")
    return checks


if __name__ == "__main__":
    main()
