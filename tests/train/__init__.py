"""Shared pieces of the training tests: frozen layers, factors, and the float64 oracle.

``linear(in, out, dtype, bias)``: a frozen ``nn.Linear``; ``factors(out, in, r, dtype)``: a
trainable ``(A, B)`` pair; ``lora_ref(x, layer, a, b, s)``: the unfused LoRA linear in
float64 under autograd (what PEFT's module computes); ``rel_err``: max |a - b| / max |b|.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(in_f: int, out_f: int, dtype: torch.dtype = torch.float64,
           bias: bool = True, device: str = "cpu") -> torch.nn.Linear:
    return torch.nn.Linear(in_f, out_f, bias=bias).to(device, dtype).requires_grad_(False)


def factors(out_f: int, in_f: int, rank: int = 4, dtype: torch.dtype = torch.float64,
            scale: float = 0.3, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    a = (torch.randn(rank, in_f, dtype=dtype, device=device) * scale).requires_grad_()
    b = (torch.randn(out_f, rank, dtype=dtype, device=device) * scale).requires_grad_()
    return a, b


def wide(t: torch.Tensor | None) -> torch.Tensor | None:
    """A float64 leaf copy of ``t`` that requires grad (None stays None)."""
    return None if t is None else t.detach().double().requires_grad_()


def lora_ref(x: torch.Tensor, layer: torch.nn.Linear, a: torch.Tensor | None,
             b: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``x W^T + bias + scale * x A^T B^T`` in float64, by autograd's own ops."""
    bias = None if layer.bias is None else layer.bias.double()
    y = F.linear(x, layer.weight.double(), bias)
    return y if a is None else y + scale * (x @ a.T @ b.T)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)
            ).item()
