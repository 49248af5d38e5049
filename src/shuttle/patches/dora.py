"""DoRA: weight decomposition around an inner patch.

With ``V = W + s * delta`` (the inner patch) and magnitude ``m``, the decomposed weight is
``D = m * V / ||V||``, the norm taken per output row (``m`` shaped (out,) or (out, 1, ...)) or per
input column (``m`` shaped (1, in, ...)), over the axes where ``m`` has size one.

Tools disagree on how a strength ``k`` enters (see docs/formats.md):
    "inner" (PEFT ``lora_magnitude_vector``):  V = W + k * s * delta;   W' = m * V / ||V||
    "blend" (LyCORIS/ComfyUI ``dora_scale``):  V = W + s * delta;       W' = W + k * (D - W)
At k = 1 both give D.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

from shuttle.errors import ShapeMismatchError
from shuttle.patches.patch import Patch, Tensorish, materialize, register_patch

__all__ = ["DoRA"]


@register_patch("dora")
@dataclasses.dataclass(frozen=True, eq=False)
class DoRA(Patch):
    """Magnitude ``m`` and direction ``W + s * delta`` of an inner (usually low-rank) patch."""

    magnitude: Tensorish = None  # type: ignore[assignment]
    inner: Patch = None  # type: ignore[assignment]
    mode: Literal["inner", "blend"] = "inner"
    tensor_fields = ("magnitude",)
    additive = False

    def tensors(self):  # noqa: D102 - the inner patch's tensors belong to this patch too
        yield from super().tensors()
        for name, t in self.inner.tensors():
            yield f"inner.{name}", t

    def load(self, device=None):  # noqa: D102
        m = materialize(self.magnitude)
        return dataclasses.replace(
            self, magnitude=m if device is None else m.to(device), inner=self.inner.load(device)
        )

    @property
    def rank(self) -> int | None:
        return self.inner.rank

    @property
    def alpha(self) -> float | None:
        return self.inner.alpha

    @property
    def out_rows(self) -> int | None:
        return self.inner.out_rows

    def _mag_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Broadcastable shape of m for a weight of ``shape``."""
        m = tuple(self.magnitude.shape)
        numel = math.prod(m)
        if self.mode == "inner" and numel == shape[0]:
            # PEFT's magnitude is always per output row, (1, out, 1, 1) for convs: with
            # in == out the literal broadcast below would read it as per input column.
            return (shape[0], *([1] * (len(shape) - 1)))
        if len(m) == len(shape) and all(a in (1, b) for a, b in zip(m, shape, strict=True)):
            return m
        if numel == shape[0]:  # (out,) or (out, 1): per output row
            return (shape[0], *([1] * (len(shape) - 1)))
        if len(shape) > 1 and numel == shape[1]:  # (1, in): per input column
            return (1, shape[1], *([1] * (len(shape) - 2)))
        return m

    def check(self, shape: tuple[int, ...], name: str) -> None:
        shape = tuple(shape)
        self.inner.check(shape, name)
        ms = self._mag_shape(shape)
        if len(ms) != len(shape) or not all(a in (1, b) for a, b in zip(ms, shape, strict=True)):
            raise ShapeMismatchError(
                f"DoRA magnitude for {name!r} has shape {tuple(self.magnitude.shape)}, which "
                f"matches neither the output rows nor the input columns of shape {shape}."
            )

    def delta(self, shape: tuple[int, ...]) -> torch.Tensor:
        raise TypeError("a DoRA delta depends on the weight; use apply()")

    def apply(self, weight: torch.Tensor, strength: float) -> torch.Tensor:
        shape = tuple(weight.shape)
        ms = self._mag_shape(shape)
        m = materialize(self.magnitude).float().reshape(ms)
        dims = tuple(i for i, (a, b) in enumerate(zip(ms, shape, strict=True)) if a == 1 and b > 1)
        inner_k = strength if self.mode == "inner" else 1.0
        v = self.inner.apply(weight.clone(), inner_k)
        d = v.mul_(m / torch.linalg.vector_norm(v, dim=dims, keepdim=True))
        if self.mode == "inner":
            return weight.copy_(d)
        return weight.add_(d.sub_(weight), alpha=strength)
