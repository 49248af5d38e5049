"""Rounding a float32 result to the weight's dtype once: to nearest, or stochastically.

Stochastic rounding picks one of the two neighbours of ``x`` in the target dtype with
probability proportional to closeness, so ``E[round(x)] = x``: many small merges do not drift.
Its random stream is seeded from the parameter name, so a merge is repeatable. The rounding
itself lives in :mod:`shuttle.weights.rounding`; this module adds the seeding.
"""

from __future__ import annotations

import zlib

import torch

# One implementation for every float dtype (float8 included): it steps bit patterns rather than
# calling torch.nextafter, which has no float8 kernel.
from shuttle.weights.representation import Rounding
from shuttle.weights.rounding import round_float, stochastic_round

__all__ = ["Rounding", "param_seed", "round_to", "stochastic_round"]


def param_seed(name: str, seed: int | None) -> int:
    """A 63-bit seed from a parameter name (CRC32) and an optional user seed."""
    return (zlib.crc32(name.encode()) ^ ((seed or 0) * 0x9E3779B1)) & (2**63 - 1)


def round_to(x: torch.Tensor, dtype: torch.dtype, rounding: Rounding, name: str,
             seed: int | None = None) -> torch.Tensor:
    """``x`` (float32) in ``dtype``, rounded once by ``rounding``; seeded by ``name``."""
    g = None
    if rounding == "stochastic" and dtype not in (torch.float32, torch.float64):
        g = torch.Generator(device=x.device)
        g.manual_seed(param_seed(name, seed))
    return round_float(x, dtype, rounding, g)
