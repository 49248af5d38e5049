"""Dense payloads: an additive ``Diff`` and a replacing ``Set``.

``Diff`` covers LyCORIS full (``diff``/``diff_b``), norm (``w_norm``/``b_norm``), ComfyUI
``.diff``/``.diff_b`` and PEFT's ``lora_B.bias``. ``Set`` covers ``.set_weight`` and the BFL
control LoRA's norm scales: the parameter becomes ``strength * value``, an interpolation from zero.
"""

from __future__ import annotations

import dataclasses

import torch

from shuttle.errors import ShapeMismatchError
from shuttle.patches.patch import Patch, Tensorish, materialize, register_patch

__all__ = ["Diff", "Set"]


def _check_exact(patch: Patch, t: Tensorish, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ShapeMismatchError(
            f"{patch.kind} patch for {name!r} has shape {tuple(t.shape)} but the parameter has "
            f"shape {tuple(shape)}. Dense payloads must match exactly; load the adapter into the "
            "model it was made for."
        )


@register_patch("diff")
@dataclasses.dataclass(frozen=True, eq=False)
class Diff(Patch):
    """``delta = scale * diff`` with ``diff`` shaped like the parameter."""

    diff: Tensorish
    scale: float = 1.0
    tensor_fields = ("diff",)

    def check(self, shape: tuple[int, ...], name: str) -> None:
        _check_exact(self, self.diff, shape, name)

    @property
    def out_rows(self) -> int | None:
        return self.diff.shape[0] if len(self.diff.shape) else None

    @property
    def in_columns(self) -> int | None:
        return self.diff.shape[1] if len(self.diff.shape) == 2 else None

    def delta(self, shape: tuple[int, ...]) -> torch.Tensor:
        return materialize(self.diff).float().mul(self.scale).reshape(shape)


@register_patch("set")
@dataclasses.dataclass(frozen=True, eq=False)
class Set(Patch):
    """The parameter becomes ``strength * value``."""

    value: Tensorish
    tensor_fields = ("value",)
    additive = False

    def check(self, shape: tuple[int, ...], name: str) -> None:
        _check_exact(self, self.value, shape, name)

    @property
    def out_rows(self) -> int | None:
        return self.value.shape[0] if len(self.value.shape) else None

    def delta(self, shape: tuple[int, ...]) -> torch.Tensor:
        return materialize(self.value).float().reshape(shape)

    def apply(self, weight: torch.Tensor, strength: float) -> torch.Tensor:
        return weight.copy_(self.delta(weight.shape)).mul_(strength)
