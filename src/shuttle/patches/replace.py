"""A trained copy of a whole parameter (or of some of its rows), moved to by strength:
``W + m * (value - W)``.

PEFT's ``modules_to_save`` (a head or an embedding trained in full beside the LoRA factors) and
``bias="all"``/``"lora_only"`` save the trained tensors themselves; PEFT swaps them in whole,
whatever the adapter's scale. Here strength ``m`` interpolates from the model's weight ``W`` to
the saved ``value``: ``m = 1`` gives ``value`` exactly (what PEFT computes), ``m = 0`` leaves
``W``, and any ``m`` is a straight line between the two, as for every additive kind (a head at
``m = 0.5`` is halfway to its fine-tuned self, not ``0.5 * value`` as :class:`~shuttle.patches.Set`
would give, a head of half the logits).

PEFT's ``trainable_token_indices`` trains chosen rows of an embedding (new tokens) and saves
their values: :class:`ReplaceRows` moves those rows alone the same way.
"""

from __future__ import annotations

import dataclasses

import torch

from shuttle.errors import ShapeMismatchError
from shuttle.patches.kind import register_patch
from shuttle.patches.patch import Patch, Tensorish, materialize

__all__ = ["Replace", "ReplaceRows"]


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


@register_patch("replace_rows")
@dataclasses.dataclass(frozen=True, eq=False)
class ReplaceRows(Patch):
    """Rows ``indices`` of the parameter become ``torch.lerp(W[indices], value, strength)``.

    Attributes:
        indices: the rows (token ids), distinct, in the order of ``value``'s rows.
        value: (len(indices), dim) trained values of those rows.
    """

    indices: tuple[int, ...]
    value: Tensorish
    tensor_fields = ("value",)
    additive = False

    def check(self, shape: tuple[int, ...], name: str) -> None:
        shape = tuple(shape)
        rows = self.value.shape[0] if len(self.value.shape) == 2 else None
        fits = (len(shape) == 2 and rows == len(self.indices) and self.value.shape[1] == shape[1]
                and all(0 <= i < shape[0] for i in self.indices))
        if not fits:
            raise ShapeMismatchError(
                f"replace_rows patch for {name!r} (trained rows {list(self.indices)[:8]}"
                f"{' ...' if len(self.indices) > 8 else ''} of an embedding) has values of shape "
                f"{tuple(self.value.shape)}, which do not fit a parameter of shape {shape}; load "
                "the adapter into the model it was trained from (with its resized vocabulary)."
            )

    def apply(self, weight: torch.Tensor, strength: float) -> torch.Tensor:
        index = torch.tensor(self.indices, device=weight.device)
        value = materialize(self.value).to(weight.device, weight.dtype)
        return weight.index_copy_(0, index, weight.index_select(0, index).lerp_(value, strength))
