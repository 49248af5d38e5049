"""Rounding a float32 result to the weight's dtype once: to nearest, or stochastically.

Stochastic rounding picks one of the two neighbours of ``x`` in the target dtype with
probability proportional to closeness, so ``E[round(x)] = x``: many small merges do not drift.
Its random stream is seeded from the parameter name, so a merge is repeatable.
"""

from __future__ import annotations

import zlib
from typing import Literal

import torch

__all__ = ["Rounding", "round_to", "stochastic_round"]

Rounding = Literal["nearest", "stochastic"]


def param_seed(name: str, seed: int | None) -> int:
    """A 63-bit seed from a parameter name (CRC32) and an optional user seed."""
    return (zlib.crc32(name.encode()) ^ ((seed or 0) * 0x9E3779B1)) & (2**63 - 1)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Round float32 ``x`` to ``dtype`` stochastically (unbiased).

    With ``n`` the nearest value in ``dtype`` and ``o`` the neighbour on the other side of ``x``,
    the result is ``o`` with probability ``|x - n| / |o - n|`` and ``n`` otherwise.
    Non-finite values and values exactly representable are returned as the nearest.
    """
    n = x.to(dtype)
    n32 = n.float()
    err = x - n32
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(dtype)
    o = torch.nextafter(n, toward)
    gap = o.float() - n32
    p = torch.where(gap != 0, err / gap, torch.zeros_like(err))
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return torch.where(u < p, o, n)


def round_to(x: torch.Tensor, dtype: torch.dtype, rounding: Rounding, name: str,
             seed: int | None = None) -> torch.Tensor:
    """``x`` (float32) in ``dtype``, rounded once by ``rounding``; seeded by ``name``."""
    if rounding == "nearest" or dtype in (torch.float32, torch.float64):
        return x.to(dtype)
    g = torch.Generator(device=x.device)
    g.manual_seed(param_seed(name, seed))
    return stochastic_round(x, dtype, g)
