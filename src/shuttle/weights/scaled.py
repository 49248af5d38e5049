"""Symmetric absmax codes times a float scale, per row or per tensor: the form quanto's
``QBytesTensor`` and torchao's ``Float8Tensor`` / ``Int8Tensor`` share (each library's module
says how it stores it).

The weight is ``codes * scale`` with int8 or float8 codes; :func:`absmax_encode` re-encodes a
float32 weight at the same granularity (``scale = amax / qmax``), and :class:`ScaledCodes`
gives a representation of that form its ``dequantize``, ``encode`` and fused ``merge_lowrank``
(:func:`shuttle.kernels.merge_scaled.merge_scaled`) from its declared fields.
"""

from __future__ import annotations

import dataclasses

import torch

from shuttle.kernels.rounding import Rounding, round_float
from shuttle.weights.representation import WeightRepresentation

__all__ = ["ScaledCodes", "absmax_encode"]


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


class ScaledCodes(WeightRepresentation):
    """A representation whose weight is ``codes * scale``: int8/float8 codes in the field
    ``shape_field`` names (of the logical shape) and a float ``scale`` field broadcastable to
    them (``(rows, 1)`` per row, or one value). Subclasses are dataclasses declaring those
    fields (and ``compute``).
    """

    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return getattr(self, self.shape_field).float() * self.scale.float()

    def encode(self, x: torch.Tensor, rounding: Rounding = "nearest",
               generator: torch.Generator | None = None) -> ScaledCodes:
        codes, scale = absmax_encode(x, getattr(self, self.shape_field).dtype, self.scale,
                                     rounding, generator)
        return dataclasses.replace(self, **{self.shape_field: codes, "scale": scale})

    def merge_lowrank(self, up: torch.Tensor, down: torch.Tensor, seg: list[int],
                      scales: list[float], *, rounding: Rounding = "nearest",
                      seed: int = 0) -> ScaledCodes | None:
        """``encode(dequantize() + sum_i scales[i] * up[:, seg_i] @ down[seg_i])`` by the fused
        kernel (:func:`shuttle.kernels.merge_scaled.merge_scaled`), without a dense weight.

        Same form as :meth:`encode` (scale ``amax / qmax`` per row or per tensor, in the
        scale's dtype; other fields kept). Nearest rounding equals ``encode`` except where a
        float32 rounding (summation order, the kernel's fused dequantize-and-add: see
        merge_scaled) moves a value across a midpoint; stochastic rounding draws from the
        kernel's stream (``seed``, element index).

        Returns:
            The merged weight, or None (the caller then dequantizes, applies and encodes): a
            scale of another granularity (per column, blockwise), codes other than int8/
            float8_e4m3fn/float8_e5m2, no Triton, not on CUDA (nor interpreted), float8 on a
            GPU before sm89, non-contiguous codes, or a merged weight that is not finite.
        """
        from shuttle.kernels.merge_scaled import merge_scaled_or_none  # Triton is optional

        out = merge_scaled_or_none(getattr(self, self.shape_field), self.scale, up, down, seg,
                                   scales, rounding=rounding, seed=seed)
        if out is None:
            return None
        return dataclasses.replace(self, **{self.shape_field: out[0], "scale": out[1]})
