"""Rounding float32 to a narrower float dtype: to nearest, or stochastically (unbiased).

The pure-PyTorch rounding every layer shares (the fused merge kernels' reference, the weight
representations' encoders, the merges' single rounding): it lives in the lowest layer using it.

Stochastic rounding here steps the target's bit pattern instead of calling ``torch.nextafter``
(which has no float8 kernel): IEEE-like floats are sign-magnitude, so within one sign the
integer view is monotonic in magnitude, and the neighbour of a finite value ``n`` on the far
side of ``x`` is the bit pattern one step away from ``n``'s (toward zero or away from it).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["Rounding", "round_float", "stochastic_round"]

Rounding = Literal["nearest", "stochastic"]

# Same-width integer views; float8 bytes fit uint8, 16-bit floats are viewed as int16 and
# masked back to unsigned in int32 arithmetic.
_INT_VIEW = {1: torch.uint8, 2: torch.int16}


def stochastic_round(x: torch.Tensor, dtype: torch.dtype,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Round float32 ``x`` to ``dtype`` (8 or 16 bits) stochastically.

    With ``n`` the nearest value of ``dtype`` and ``o`` the neighbour on the other side of ``x``,
    the result is ``o`` with probability ``|x - n| / |o - n|``, else ``n``; so
    ``E[result] = x``. Exact values, and values whose neighbour is not finite, round to ``n``.
    One ``torch.rand`` draw of ``x.shape`` is taken from ``generator``.
    """
    size = torch.empty((), dtype=dtype).element_size()
    if size not in _INT_VIEW:
        return x.to(dtype)
    x = x.float()
    n = x.to(dtype)
    n32 = n.float()
    err = x - n32
    sign_bit = 1 << (8 * size - 1)
    bits = n.view(_INT_VIEW[size]).to(torch.int32) & (2 * sign_bit - 1)  # unsigned pattern
    mag = bits & (sign_bit - 1)
    negative = (bits & sign_bit) != 0
    up = err > 0
    # From zero (either sign) the neighbour is the smallest subnormal of err's sign; otherwise
    # moving up in value means a larger magnitude for a positive n, a smaller for a negative n.
    stepped = torch.where(up != negative, bits + 1, bits - 1)
    from_zero = torch.where(up, torch.ones_like(bits), torch.full_like(bits, sign_bit | 1))
    o_bits = torch.where(mag == 0, from_zero, stepped)
    o = o_bits.to(_INT_VIEW[size]).view(dtype)  # int32 -> int16 wraps, as the view needs
    gap = o.float() - n32
    ok = torch.isfinite(gap) & (gap != 0) & torch.isfinite(err)
    p = torch.where(ok, err / torch.where(ok, gap, torch.ones_like(gap)), torch.zeros_like(err))
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return torch.where(u < p, o, n)


def round_float(x: torch.Tensor, dtype: torch.dtype, rounding: Rounding = "nearest",
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` in ``dtype``, rounded once by ``rounding`` (float32/float64 targets: a cast)."""
    if rounding == "nearest" or dtype in (torch.float32, torch.float64):
        return x.to(dtype)
    return stochastic_round(x, dtype, generator)
