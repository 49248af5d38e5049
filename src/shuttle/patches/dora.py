"""DoRA: weight decomposition around an inner patch.

With ``V = W + s * delta`` (the inner patch) and magnitude ``m``, the decomposed weight is
``D = m * V / ||V||``, the norm taken per output row (``m`` shaped (out,) or (out, 1, ...)) or per
input column (``m`` shaped (1, in, ...)), over the axes where ``m`` has size one.

Tools disagree on how a strength ``k`` enters (see docs/formats.md):
    "inner"   (PEFT ``lora_magnitude_vector``):  V = W + k * s * delta;  W' = m * V / ||V||
    "blend"   (ComfyUI, a ``dora_scale``):       V = W + s * delta;      W' = W + k * (D - W)
    "lycoris" (LyCORIS, a ``dora_scale``):       V = W + s * delta;      W' = V + k * (D - V)
At k = 1 all three give D. For a ``dora_scale`` both tools divide by ``||V|| + eps`` (eps of
float32). LyCORIS computes ``W' = V * (k * (m / (||V|| + eps) - 1) + 1)`` in ``weight_decompose``
(its forward, ``merge_to`` and ``get_merged_weight`` alike), which is ``V + k * (D - V)``: at
k = 0 it would leave the plain low-rank update ``V``, but a strength of 0 means off in shuttle
(zero strengths are dropped), so "lycoris" leaves the weight as it was at exactly k = 0.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

from shuttle.errors import AdapterFormatError, ShapeMismatchError, UnsupportedFormatError
from shuttle.patches.kind import Found, PatchKind, register_kind, spell_patch
from shuttle.patches.patch import Patch, Tensorish, materialize

__all__ = ["DoRA", "DoRAKind", "DoraMode"]

DoraMode = Literal["inner", "blend", "lycoris"]


@dataclasses.dataclass(frozen=True, eq=False)
class DoRA(Patch):
    """Magnitude ``m`` and direction ``W + s * delta`` of an inner (usually low-rank) patch.

    Attributes:
        magnitude: ``m``, per output row or per input column (see the module docstring).
        inner: the patch giving ``s * delta`` (LoRA, LoHa, LoKr).
        mode: how a strength enters: ``"inner"`` (PEFT), ``"blend"`` (ComfyUI) or
            ``"lycoris"`` (LyCORIS); see the module docstring.
    """

    magnitude: Tensorish = None  # type: ignore[assignment]
    inner: Patch = None  # type: ignore[assignment]
    mode: DoraMode = "inner"
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
        if self.mode == "inner":
            v = self.inner.apply(weight.clone(), strength)
            return weight.copy_(v.mul_(m / torch.linalg.vector_norm(v, dim=dims, keepdim=True)))
        if strength == 0:
            return weight
        v = self.inner.apply(weight.clone(), 1.0)
        # m / (||V|| + eps), as LyCORIS's weight_decompose and ComfyUI compute it
        ratio = m / torch.linalg.vector_norm(v, dim=dims, keepdim=True).add_(
            torch.finfo(v.dtype).eps)
        if self.mode == "lycoris":
            # V * (k * (ratio - 1) + 1) = V + k * (D - V)
            return weight.copy_(v.mul_(ratio.sub_(1).mul_(strength).add_(1)))
        assert self.mode == "blend", f"unknown DoRA mode {self.mode!r}"
        return weight.add_(v.mul_(ratio).sub_(weight), alpha=strength)


@register_kind
class DoRAKind(PatchKind):
    """DoRA around the module's main patch: PEFT's ``lora_magnitude_vector`` (mode "inner")
    or a LyCORIS/ComfyUI ``dora_scale`` (mode "blend"; ``LoRA.with_dora`` picks another).
    """

    name = "dora"
    patch = DoRA
    roles = {"magnitude": ("lora_magnitude_vector", "lora_magnitude_vector.weight",
                           "lora_magnitude_vector.default",
                           "lora_magnitude_vector.default.weight"),
             "dora_scale": ("dora_scale",)}
    stage = "wrap"

    def build(self, found: Found) -> list[Patch]:  # noqa: D102
        if found.main is None:
            raise AdapterFormatError(
                f"{found.source}: module {found.module!r} has a DoRA magnitude but no "
                "LoRA/LoHa/LoKr factors to decompose; the file is incomplete."
            )
        if found.has("magnitude"):
            return [DoRA("weight", magnitude=found.get("magnitude"), inner=found.main,
                         mode="inner")]
        return [DoRA("weight", magnitude=found.get("dora_scale"), inner=found.main,
                     mode="blend")]

    def spell(self, module: str, patch: DoRA, to: str,  # type: ignore[override]
              tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # noqa: D102
        if patch.mode == "inner":
            raise UnsupportedFormatError(
                f"module {module!r}: PEFT's magnitude vector takes strength differently from a "
                f"LyCORIS dora_scale, which is the only DoRA {to} spells; convert to peft "
                "instead."
            )
        out = spell_patch(module, patch.inner, to)
        m = tensors["magnitude"]
        out[f"{module}.dora_scale"] = m.reshape(m.shape[0], 1) if m.dim() == 1 else m
        return out
