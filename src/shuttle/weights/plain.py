"""Plain floating-point weights (float16, bfloat16, float32, float64): the tensor is the weight."""

from __future__ import annotations

import dataclasses

import torch

from shuttle.kernels.rounding import Rounding, round_float
from shuttle.weights.representation import WeightRepresentation, register_representation

__all__ = ["PLAIN_DTYPES", "PlainWeight", "is_plain_tensor"]

PLAIN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_plain_tensor(p: object) -> bool:
    """Whether ``p`` is a plain float (or float8) tensor whose storage is the weight itself.

    A ``Parameter`` counts by its ``data``: bitsandbytes' ``Params4bit`` holds uint8 bytes (not
    plain), a torchao/quanto parameter is a tensor subclass (not plain) whatever its ``dtype``.
    """
    kind = type(p)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        # the common case, without ``p.data`` (a new tensor object per call): a Parameter of
        # exactly this class wraps a plain tensor (``Parameter(subclass)`` keeps the subclass)
        return p.dtype.is_floating_point
    return (isinstance(p, torch.Tensor) and type(p.data) is torch.Tensor
            and p.dtype.is_floating_point)


@register_representation("plain")
@dataclasses.dataclass
class PlainWeight(WeightRepresentation):
    """A dense float tensor; ``encode`` rounds to its dtype once (nearest or stochastic)."""

    data: torch.Tensor

    tensor_names = ("data",)
    param_attrs = {"data": "data"}

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.data.dtype

    def dequantize(self) -> torch.Tensor:
        return self.data.float()

    def encode(self, x: torch.Tensor, rounding: Rounding = "nearest",
               generator: torch.Generator | None = None) -> PlainWeight:
        return PlainWeight(round_float(x, self.data.dtype, rounding, generator))

    @classmethod
    def accepts(cls, tensor: torch.Tensor) -> bool:
        # Exactly a tensor or a parameter: a library's tensor subclass (a bitsandbytes
        # Params4bit may store its packed bytes as bf16) belongs to that library's class.
        return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.dtype in PLAIN_DTYPES

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> PlainWeight:
        return cls(tensor)
