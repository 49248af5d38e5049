"""Rounding float32 to a narrower float dtype: to nearest, or stochastically (unbiased).

The pure-PyTorch rounding every layer shares (the fused merge kernels' reference, the weight
representations' encoders, the merges' single rounding): it lives in the lowest layer using it.

Stochastic rounding here steps the target's bit pattern instead of calling ``torch.nextafter``
(which has no float8 kernel): IEEE-like floats are sign-magnitude, so within one sign the
integer view is monotonic in magnitude, and the neighbour of a finite value ``n`` on the far
side of ``x`` is the bit pattern one step away from ``n``'s (toward zero or away from it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

__all__ = ["GlobalDraws", "Rounding", "hash_uniform", "round_float", "stochastic_round"]

Rounding = Literal["nearest", "stochastic"]

# Same-width integer views; float8 bytes fit uint8, 16-bit floats are viewed as int16 and
# masked back to unsigned in int32 arithmetic.
_INT_VIEW = {1: torch.uint8, 2: torch.int16}


_U32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # tiles._mix32 on uint32 values held in int64: the products wrap mod 2**64, their low 32
    # bits are the uint32 products'.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _U32
    return x ^ (x >> 16)


def hash_uniform(seed: int, idx: torch.Tensor) -> torch.Tensor:
    """The Triton kernels' ``tiles.hash_uniform`` in PyTorch: a float32 in [0, 1) per element of
    int64 ``idx`` (non-negative), a pure function of ``(seed, idx)``; ``seed`` is folded to 32
    bits as the kernels' launches fold it (``launch.seed32``).
    """
    s32 = (seed ^ (seed >> 32)) & _U32
    lo, hi = idx & _U32, (idx >> 32) & _U32
    x = _mix32(lo ^ _mix32(hi ^ s32))
    return (x >> 8).to(torch.float32) * (1.0 / 16777216.0)


@dataclasses.dataclass(frozen=True)
class GlobalDraws:
    """Stochastic rounding's draws for a window of a larger tensor, by global element index.

    A rank holding the window ``starts + local shape`` of a tensor of ``shape`` (a DTensor
    shard) draws ``hash_uniform(seed, i)`` for each element's row-major index ``i`` in the
    whole tensor: the same number for the same element whatever the sharding, so a sharded
    stochastic merge gives the bits of an unsharded one on any world size.
    """

    seed: int
    starts: tuple[int, ...]
    shape: tuple[int, ...]

    def uniform(self, local: torch.Size | tuple[int, ...], device: torch.device | str
                ) -> torch.Tensor:
        """The draws of the ``local``-shaped window, float32 on ``device``."""
        idx = torch.zeros((), dtype=torch.int64, device=device)
        for d, (start, n) in enumerate(zip(self.starts, local, strict=True)):
            stride = math.prod(self.shape[d + 1:])
            pos = (torch.arange(n, dtype=torch.int64, device=device) + start) * stride
            idx = idx.unsqueeze(-1) + pos  # broadcasting builds the row-major index grid
        return hash_uniform(self.seed, idx.reshape(tuple(local)))


def stochastic_round(x: torch.Tensor, dtype: torch.dtype,
                     generator: torch.Generator | None = None,
                     noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round float32 ``x`` to ``dtype`` (8 or 16 bits) stochastically.

    With ``n`` the nearest value of ``dtype`` and ``o`` the neighbour on the other side of ``x``,
    the result is ``o`` with probability ``|x - n| / |o - n|``, else ``n``; so
    ``E[result] = x``. Exact values, and values whose neighbour is not finite, round to ``n``.
    The uniform draws are ``noise`` (float32 of ``x.shape``, e.g. :meth:`GlobalDraws.uniform`)
    or one ``torch.rand`` of ``x.shape`` from ``generator``.
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
    u = noise if noise is not None else torch.rand(x.shape, generator=generator,
                                                   device=x.device, dtype=torch.float32)
    return torch.where(u < p, o, n)


def round_float(x: torch.Tensor, dtype: torch.dtype, rounding: Rounding = "nearest",
                generator: torch.Generator | None = None,
                noise: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` in ``dtype``, rounded once by ``rounding`` (float32/float64 targets: a cast);
    stochastic draws from ``noise`` or ``generator`` (:func:`stochastic_round`).
    """
    if rounding == "nearest" or dtype in (torch.float32, torch.float64):
        return x.to(dtype)
    return stochastic_round(x, dtype, generator, noise)
