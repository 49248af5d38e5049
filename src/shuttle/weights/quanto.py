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

from shuttle.errors import UnsupportedLayerError
from shuttle.optional import import_optional
from shuttle.weights.representation import Rounding, WeightRepresentation, register_representation
from shuttle.weights.rounding import round_float

__all__ = ["QuantoWeight", "absmax_encode"]


def absmax_encode(x: torch.Tensor, dtype: torch.dtype, scale_like: torch.Tensor,
                  rounding: Rounding = "nearest", generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization of float32 ``x`` to int8/float8 ``dtype``.

    ``scale = amax / qmax`` over the dims where ``scale_like`` broadcasts (all but rows for a
    ``(rows, 1)`` scale, all for one value), stored in ``scale_like``'s dtype and shape;
    ``data = clamp(round(x / scale))``. Integer rounding is to nearest (half to even, as
    ``torch.round``) or stochastic (floor, then up with probability equal to the fraction:
    ``E[data] = x / scale``); float8 rounding is :func:`~shuttle.weights.round_float`.

    Returns:
        ``(data, scale)``.
    """
    x = x.float()
    scale_b = scale_like.reshape((1,) * (x.dim() - scale_like.dim()) + scale_like.shape)
    dims = [d for d in range(x.dim()) if scale_b.shape[d] == 1]
    qmax = torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max
    amax = x.abs().amax(dim=dims, keepdim=True) if dims else x.abs()
    # x is divided by the scale as stored (its dtype may be the model's); an all-zero row gets
    # scale 1, where an absmax quantizer would divide 0 by 0.
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).to(scale_like.dtype)
    q = x / scale.float()
    if dtype.is_floating_point:
        data = round_float(q.clamp(-qmax, qmax), dtype, rounding, generator)
    else:
        info = torch.iinfo(dtype)
        if rounding == "nearest":
            q = torch.round(q)
        else:
            lo = q.floor()
            u = torch.rand(q.shape, generator=generator, device=q.device)
            q = lo + (u < q - lo).float()
        data = q.clamp(info.min, info.max).to(dtype)
    return data, scale.reshape(scale_like.shape)


def _quanto() -> Any:
    """The ``optimum.quanto`` module, or an error naming the extra to install."""
    return import_optional("optimum.quanto", "optimum-quanto weights",
                           "pip install shuttle[quanto]")


@register_representation("quanto")
@dataclasses.dataclass
class QuantoWeight(WeightRepresentation):
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

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * self.scale.float()

    def encode(self, x: torch.Tensor, rounding: Rounding = "nearest",
               generator: torch.Generator | None = None) -> QuantoWeight:
        data, scale = absmax_encode(x, self.data.dtype, self.scale, rounding, generator)
        return dataclasses.replace(self, data=data, scale=scale)

    def merge_lowrank(self, up: torch.Tensor, down: torch.Tensor, seg: list[int],
                      alpha: list[float], *, rounding: Rounding = "nearest",
                      seed: int = 0) -> QuantoWeight | None:
        """``encode(dequantize() + sum_i alpha[i] * up[:, seg_i] @ down[seg_i])`` by the fused
        kernel (:func:`shuttle.kernels.merge_scaled.merge_scaled`), without a dense weight.

        Same form as :meth:`encode` (``absmax_encode``: scale ``amax / qmax`` per row or per
        tensor, in the scale's dtype). Nearest rounding equals ``encode`` except where float32
        summation order moves a value across a midpoint; stochastic rounding draws from the
        kernel's stream (``seed``, element index).

        Returns:
            The merged weight, or None (the caller then dequantizes, applies and encodes): a
            scale that is neither per row nor per tensor, data other than int8/float8_e4m3fn/
            float8_e5m2, no Triton, not on CUDA (nor interpreted), float8 on a GPU before sm89,
            non-contiguous data, or a merged weight that is not finite.
        """
        from shuttle.kernels.merge_scaled import merge_scaled_or_none  # Triton is optional

        out = merge_scaled_or_none(self.data, self.scale, up, down, seg, alpha,
                                   rounding=rounding, seed=seed)
        return None if out is None else dataclasses.replace(self, data=out[0], scale=out[1])

    @classmethod
    def accepts(cls, tensor: torch.Tensor) -> bool:
        if not type(tensor).__module__.startswith("optimum.quanto"):
            return False  # checked first: no quanto import for other tensors
        return isinstance(tensor, _quanto().QBytesTensor)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> QuantoWeight:
        """Wrap a ``QBytesTensor`` (tensors shared, not copied)."""
        return cls(tensor._data, tensor._scale, tensor.dtype)

    def write_into(self, param: torch.Tensor) -> None:
        """Copy into an existing quanto tensor of the same form, in place.

        Raises:
            UnsupportedLayerError: ``param`` has another shape, data dtype or scale shape.
        """
        target = QuantoWeight.from_tensor(param)
        if (target.data.shape, target.data.dtype, target.scale.shape) != (
                self.data.shape, self.data.dtype, self.scale.shape):
            raise UnsupportedLayerError(
                f"cannot write a quanto weight {tuple(self.data.shape)} {self.data.dtype} into "
                f"one of {tuple(target.data.shape)} {target.data.dtype} with another scale")
        with torch.no_grad():
            target.data.copy_(self.data)
            target.scale.copy_(self.scale)

    def rebind(self, param: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Point a quanto ``QBytesTensor``'s ``_data`` and ``_scale`` at ``tensors``; no copy."""
        param._data, param._scale = tensors["data"], tensors["scale"]
