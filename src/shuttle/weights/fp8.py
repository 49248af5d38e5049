"""Float8 weights (``float8_e4m3fn``, ``float8_e5m2``), unscaled or with a float32 scale.

The weight is ``data.float() * scale``, with ``scale`` absent (1), one number for the tensor
(shape ``()``), or one per row (shape ``(rows,)``, broadcast over the other dims).
Re-encoding after a merge recomputes the scale as ``amax / finfo.max`` at the same granularity,
so the largest magnitude lands on the format's largest finite value; an unscaled weight is
clamped to ``±finfo.max`` (float8 has no room to grow, and e4m3fn has no infinity).
"""

from __future__ import annotations

import dataclasses

import torch

from shuttle.errors import ShuttleError
from shuttle.kernels.rounding import Rounding, round_float
from shuttle.weights.representation import WeightRepresentation, register_representation

__all__ = ["FP8_DTYPES", "Fp8Weight"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@register_representation("fp8")
@dataclasses.dataclass
class Fp8Weight(WeightRepresentation):
    """A float8 tensor, optionally scaled per tensor or per row.

    Attributes:
        data: the float8 values, of the weight's logical shape.
        scale: ``None``, a float32 scalar, or float32 of shape ``(data.shape[0],)``.
        compute_dtype: the dtype layers compute in (default bfloat16).

    Raises:
        ShuttleError: ``data`` is not float8, or ``scale`` has another shape.
    """

    data: torch.Tensor
    scale: torch.Tensor | None = None
    compute: torch.dtype = torch.bfloat16

    tensor_names = ("data", "scale")
    param_attrs = {"data": "data"}  # a plain float8 parameter has nowhere to keep a scale

    def __post_init__(self) -> None:
        if self.data.dtype not in FP8_DTYPES:
            raise ShuttleError(f"Fp8Weight data has dtype {self.data.dtype}; expected one of "
                               f"{FP8_DTYPES}")
        s = self.scale
        if s is not None and tuple(s.shape) not in ((), tuple(self.data.shape[:1])):
            raise ShuttleError(
                f"Fp8Weight scale has shape {tuple(s.shape)}; expected () for one scale per "
                f"tensor or ({self.data.shape[0]},) for one per row"
            )

    def _broadcast(self, scale: torch.Tensor) -> torch.Tensor:
        # (rows,) -> (rows, 1, ..., 1) against data of (rows, ...); () broadcasts as is.
        return scale.reshape(scale.shape + (1,) * (self.data.dim() - scale.dim()))

    def dequantize(self) -> torch.Tensor:
        x = self.data.float()
        return x if self.scale is None else x * self._broadcast(self.scale.float())

    def encode(self, x: torch.Tensor, rounding: Rounding = "nearest",
               generator: torch.Generator | None = None) -> Fp8Weight:
        dtype = self.data.dtype
        fmax = torch.finfo(dtype).max
        x = x.float()
        scale = None
        if self.scale is not None:
            if self.scale.dim() == 0:
                amax = x.abs().amax()
            else:
                amax = x.abs().reshape(x.shape[0], -1).amax(dim=1)
            # An all-zero tensor (or row) keeps scale 1: any scale encodes zeros exactly.
            scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
            x = x / self._broadcast(scale)
        data = round_float(x.clamp(-fmax, fmax), dtype, rounding, generator)
        return dataclasses.replace(self, data=data, scale=scale)

    def merge_lowrank(self, up: torch.Tensor, down: torch.Tensor, seg: list[int],
                      scales: list[float], *, rounding: Rounding = "nearest",
                      seed: int = 0) -> Fp8Weight | None:
        """``encode(dequantize() + sum_i scales[i] * up[:, seg_i] @ down[seg_i])`` by the fused
        kernel (:func:`shuttle.kernels.merge_scaled.merge_scaled`), without a dense weight.

        The form is :meth:`encode`'s: a float32 scale ``amax / finfo.max`` at the same
        granularity, or unscaled values clamped to ``±finfo.max``. Nearest rounding equals
        ``encode`` except where a float32 rounding (summation order, the kernel's fused
        dequantize-and-add: see merge_scaled) moves a value across a midpoint; stochastic
        rounding draws from the kernel's stream (``seed``, element index).

        Returns:
            The merged weight, or None (the caller then dequantizes, applies and encodes): no
            Triton, not on CUDA (nor interpreted), a GPU before sm89, non-contiguous data, or a
            merged weight that is not finite.
        """
        from shuttle.kernels.merge_scaled import merge_scaled_or_none  # Triton is optional

        scale = None if self.scale is None else self.scale.float()  # encode's scale dtype
        out = merge_scaled_or_none(self.data, scale, up, down, seg, scales, rounding=rounding,
                                   seed=seed)
        return None if out is None else dataclasses.replace(self, data=out[0], scale=out[1])

    @classmethod
    def accepts(cls, tensor: torch.Tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor.dtype in FP8_DTYPES

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Fp8Weight:
        return cls(tensor)
