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


class BiasedBlock(Block):
    """A T5-like block: the first of its list holds a relative-position table and computes
    the bias that every later block reuses (so the first block's tensors differ)."""

    def __init__(self, dim: int, hidden: int, first: bool = False):
        super().__init__(dim, hidden)
        self.rel = nn.Embedding(9, dim) if first else None

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rel is not None:
            bias = self.rel(torch.arange(x.shape[-2], device=x.device) % 9)  # [S, dim]
        assert bias is not None
        return super().forward(x + bias), bias


class TinyT5(nn.Module):
    """An encoder whose block list is not uniform: block 0 holds the relative bias table."""

    def __init__(self, vocab: int = 64, dim: int = 32, n_blocks: int = 5,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.ModuleList(BiasedBlock(dim, 4 * dim, first=i == 0)
                                   for i in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.to(dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, bias = self.embed(tokens), None
        for b in self.block:
            x, bias = b(x, bias)
        return self.norm(x)


class Stage(nn.Module):
    """One UNet-like stage: a width change, a norm, a nonlinearity."""

    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.proj = nn.Linear(width_in, width_out)
        self.norm = nn.LayerNorm(width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.norm(self.proj(x)))


class TinyUNet(nn.Module):
    """Down and up stages of different widths (one block list each), with skip connections."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.stem = nn.Linear(dim, 16)
        self.down = nn.ModuleList([Stage(16, 32), Stage(32, 64), Stage(64, 64)])
        self.up = nn.ModuleList([Stage(64, 64), Stage(64, 32), Stage(32, 16)])
        self.out = nn.Linear(16, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, skips = self.stem(x), []
        for stage in self.down:
            h = stage(h)
            skips.append(h)
        for stage in self.up:
            h = stage(h + skips.pop())
        return self.out(h)
