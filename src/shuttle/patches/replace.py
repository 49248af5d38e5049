"""A trained copy of a whole parameter, moved to by strength: ``W + m * (value - W)``.

PEFT's ``modules_to_save`` (a head or an embedding trained in full beside the LoRA factors) and
``bias="all"``/``"lora_only"`` save the trained tensors themselves; PEFT swaps them in whole,
whatever the adapter's scale. Here strength ``m`` interpolates from the model's weight ``W`` to
the saved ``value``: ``m = 1`` gives ``value`` exactly (what PEFT computes), ``m = 0`` leaves
``W``, and any ``m`` is a straight line between the two, as for every additive kind (a head at
``m = 0.5`` is halfway to its fine-tuned self, not ``0.5 * value`` as :class:`~shuttle.patches.Set`
would give, a head of half the logits).
"""

from __future__ import annotations

import dataclasses

import torch

from shuttle.errors import ShapeMismatchError
from shuttle.patches.kind import register_patch
from shuttle.patches.patch import Patch, Tensorish, materialize

__all__ = ["Replace"]


@register_patch("replace")
@dataclasses.dataclass(frozen=True, eq=False)
class Replace(Patch):
    """The parameter becomes ``torch.lerp(W, value, strength)``: ``value`` at strength 1."""

    value: Tensorish
    tensor_fields = ("value",)
    additive = False  # the update value - W depends on the weight it replaces

    def check(self, shape: tuple[int, ...], name: str) -> None:
        if tuple(self.value.shape) != tuple(shape):
            raise ShapeMismatchError(
                f"replace patch for {name!r} (a trained copy of the whole parameter) has shape "
                f"{tuple(self.value.shape)} but the parameter has shape {tuple(shape)}; load "
                "the adapter into the model it was trained from."
            )

    @property
    def out_rows(self) -> int | None:
        return self.value.shape[0] if len(self.value.shape) else None

    def apply(self, weight: torch.Tensor, strength: float) -> torch.Tensor:
        # lerp is exact at both ends: value itself at strength 1 (end - (end - start) * 0)
        value = materialize(self.value).to(weight.dtype).reshape(weight.shape)
        return weight.lerp_(value, strength)
