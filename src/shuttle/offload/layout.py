"""``Layout``: where each tensor of a unit lies in one flat byte buffer, the same for the host
arena and every device slot of the unit (so one ``copy_`` moves a whole block).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "Layout"]

ALIGN = 16  # bytes; keeps every view aligned for vectorized loads on the device


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True)
class Layout:
    """Where each unique tensor of a unit lies in its flat ``uint8`` buffer.

    The same layout describes the host arena and the front of the device slot the unit is
    loaded into, so one ``copy_`` moves a whole block.
    """

    offsets: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[torch.Size, ...]
    nbytes: int

    @classmethod
    def of(cls, tensors: Sequence[tuple[torch.dtype, torch.Size]]) -> Layout:
        offsets, end = [], 0
        for dtype, shape in tensors:
            start = _round_up(end, ALIGN)
            offsets.append(start)
            end = start + math.prod(shape) * dtype.itemsize
        return cls(tuple(offsets), tuple(d for d, _ in tensors), tuple(s for _, s in tensors),
                   _round_up(end, ALIGN))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the tensors themselves, without alignment padding."""
        return sum(math.prod(s) * d.itemsize for d, s in zip(self.dtypes, self.shapes, strict=True))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The unit's tensors as views of ``flat`` (``uint8``, ``nbytes`` long)."""
        out = []
        for off, dtype, shape in zip(self.offsets, self.dtypes, self.shapes, strict=True):
            n = math.prod(shape) * dtype.itemsize
            out.append(flat[off:off + n].view(dtype).view(shape))
        return out
