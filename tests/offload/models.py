"""Small transformer-like models for the offload tests."""

from __future__ import annotations

import torch
from torch import nn

from shuttle import StreamConfig

# The residency modes every offload test runs through (whole model, streamed, budgeted).
RESIDENCY_MODES = {
    "whole": None,
    "stream0": StreamConfig(prefetch=0),
    "stream2": StreamConfig(prefetch=2),
    "resident": StreamConfig(prefetch=1, resident=2),
    "budget": StreamConfig(prefetch=2, vram_budget=150_000),
}


class Block(nn.Module):
    """Pre-norm attention-free mixer + MLP, with a buffer (a per-block scale)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.register_buffer("scale", torch.rand(dim) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x)) * self.scale
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class TinyDiT(nn.Module):
    """Embedding, two block lists of different widths (like Flux's double/single), a head."""

    def __init__(self, vocab: int = 64, dim: int = 32, n_blocks: int = 5, n_single: int = 3,
                 tie: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, 4 * dim) for _ in range(n_blocks))
        self.single = nn.ModuleList(Block(dim, 2 * dim) for _ in range(n_single))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight
            assert self.head.weight is self.embed.weight  # tests rely on one shared Parameter
        self.to(dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        for b in self.single:
            x = b(x)
        return self.head(self.norm(x))


def fail_on_call(n, fn):
    """``fn`` wrapped to raise RuntimeError on its ``n``-th call (failure injection)."""
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError("injected failure")
        return fn(*args, **kwargs)

    return wrapper
