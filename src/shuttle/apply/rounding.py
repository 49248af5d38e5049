"""Rounding a float32 result to the weight's dtype once: to nearest, or stochastically.

Stochastic rounding picks one of the two neighbours of ``x`` in the target dtype with
probability proportional to closeness, so ``E[round(x)] = x``: many small merges do not drift.
Its random stream is seeded from the parameter name, so a merge is repeatable. The rounding
itself lives in :mod:`shuttle.weights.rounding`; this module adds the seeding and the one
default every entry point shares (``rounding=None``): nearest into float16, bfloat16, float32
and float64, where it is the exact result's closest value, and stochastic into float8 and
quantized encodings, whose steps are coarse enough that nearest rounding drops small updates
altogether.
"""

from __future__ import annotations

import zlib

import torch

# One implementation for every float dtype (float8 included): it steps bit patterns rather than
# calling torch.nextafter, which has no float8 kernel.
from shuttle.errors import InvalidOptionError
from shuttle.weights.representation import Rounding
from shuttle.weights.rounding import round_float, stochastic_round

__all__ = ["ROUNDINGS", "Rounding", "check_rounding", "param_seed", "round_to", "rounding_for",
           "stochastic_round"]

ROUNDINGS = ("nearest", "stochastic")
_NEAREST_BY_DEFAULT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_rounding(rounding: object) -> Rounding | None:
    """``rounding`` if it is ``"nearest"``, ``"stochastic"`` or None, else
    :class:`~shuttle.errors.InvalidOptionError`.
    """
    if rounding is not None and rounding not in ROUNDINGS:
        raise InvalidOptionError(
            f"rounding={rounding!r}: expected 'nearest', 'stochastic' or None (the default: "
            "nearest into float16/bfloat16/float32/float64, stochastic into float8 and "
            "quantized weights)")
    return rounding  # type: ignore[return-value]


def rounding_for(rounding: Rounding | None, dtype: torch.dtype) -> Rounding:
    """The rounding into a ``dtype`` value: ``rounding``, or the default for that dtype."""
    if rounding is not None:
        return rounding
    return "nearest" if dtype in _NEAREST_BY_DEFAULT else "stochastic"


def param_seed(name: str, seed: int | None) -> int:
    """A 63-bit seed from a parameter name (CRC32) and an optional user seed."""
    return (zlib.crc32(name.encode()) ^ ((seed or 0) * 0x9E3779B1)) & (2**63 - 1)


def round_to(x: torch.Tensor, dtype: torch.dtype, rounding: Rounding | None, name: str,
             seed: int | None = None) -> torch.Tensor:
    """``x`` (float32) in ``dtype``, rounded once by ``rounding`` (None: the default for
    ``dtype``, see :func:`rounding_for`); seeded by ``name``.
    """
    rounding = rounding_for(rounding, dtype)
    g = None
    if rounding == "stochastic" and dtype not in (torch.float32, torch.float64):
        g = torch.Generator(device=x.device)
        g.manual_seed(param_seed(name, seed))
    return round_float(x, dtype, rounding, g)
