"""optimum-quanto weights: ``qint8`` and ``qfloat8`` ``WeightQBytesTensor`` (a frozen ``QLinear``).

The weight is ``data * scale`` with int8 or float8 ``data`` and a float ``scale`` per row (the
default, ``axis=0``: shape ``(rows, 1)``) or per tensor. quanto's own quantization (its absmax
optimizer) sets ``scale = absmax / qmax`` (127 for qint8, 448 for qfloat8_e4m3fn, 57344 for
e5m2) and ``data = clamp(round(x / scale))``; ``encode`` does the same, with stochastic rounding
on request. A quanto layer that is quantized but not frozen still holds a float weight: that
merges as a plain weight.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from shuttle.optional import import_optional
from shuttle.weights.representation import register_representation
from shuttle.weights.scaled import ScaledCodes

__all__ = ["QuantoWeight"]


def _quanto() -> Any:
    """The ``optimum.quanto`` module, or an error naming the extra to install."""
    return import_optional("optimum.quanto", "optimum-quanto weights",
                           "pip install shuttle[quanto]")


@register_representation("quanto")
@dataclasses.dataclass
class QuantoWeight(ScaledCodes):
    """An optimum-quanto ``QBytesTensor`` weight: int8/float8 data and a float scale.

    Attributes:
        data: int8 or float8 values of the logical shape (quanto's ``_data``).
        scale: float scale broadcastable to ``data`` (``(rows, 1)`` per row, or one value).
        compute: the dtype layers compute in (quanto's ``tensor.dtype``).
    """

    data: torch.Tensor
    scale: torch.Tensor
    compute: torch.dtype

    tensor_names = ("data", "scale")
    param_attrs = {"data": "_data", "scale": "_scale"}

    @classmethod
    def accepts(cls, tensor: torch.Tensor) -> bool:
        if not type(tensor).__module__.startswith("optimum.quanto"):
            return False  # checked first: no quanto import for other tensors
        return isinstance(tensor, _quanto().QBytesTensor)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> QuantoWeight:
        """Wrap a ``QBytesTensor`` (tensors shared, not copied)."""
        return cls(tensor._data, tensor._scale, tensor.dtype)
