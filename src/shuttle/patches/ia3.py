"""(IA)3 (LyCORIS): ``W' = W * (1 + m * w)``, ``w`` broadcast per output row or input column."""

from __future__ import annotations

import dataclasses
import math

import torch

from shuttle.errors import AdapterFormatError, ShapeMismatchError
from shuttle.patches.kind import Found, PatchKind, register_kind
from shuttle.patches.patch import Patch, Tensorish, materialize

__all__ = ["IA3"]


@dataclasses.dataclass(frozen=True, eq=False)
class IA3(Patch):
    """Rescales rows (or, with ``on_input``, columns) of the weight: delta = W * w."""

    weight: Tensorish
    on_input: bool = False
    tensor_fields = ("weight",)
    additive = False  # the delta depends on the weight it scales

    def _view(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.on_input:
            return (1, shape[1], *([1] * (len(shape) - 2)))
        return (shape[0], *([1] * (len(shape) - 1)))

    def check(self, shape: tuple[int, ...], name: str) -> None:
        shape = tuple(shape)
        where = "input columns" if self.on_input else "output rows"
        if len(shape) < 2:
            raise ShapeMismatchError(
                f"ia3 patch for {name!r} rescales the {where} of a matrix or conv weight, but "
                f"the parameter has shape {shape}. The adapter was made for a different model "
                "(or layer); load it into the model it was trained for, or pass a key mapping."
            )
        want = shape[1] if self.on_input else shape[0]
        if math.prod(self.weight.shape) != want:
            raise ShapeMismatchError(
                f"ia3 patch for {name!r} has {math.prod(self.weight.shape)} scales but the "
                f"parameter of shape {shape} has {want} {where}. The adapter was made for a "
                "different model (or layer); check that you load it into the model it was "
                "trained for, or pass a key mapping."
            )

    def delta(self, shape: tuple[int, ...]) -> torch.Tensor:
        raise TypeError("an (IA)3 delta depends on the weight; use apply()")

    def apply(self, weight: torch.Tensor, strength: float) -> torch.Tensor:
        w = materialize(self.weight).float().reshape(self._view(tuple(weight.shape)))
        return weight.mul_(w.mul(strength).add_(1.0))


@register_kind
class IA3Kind(PatchKind):
    """LyCORIS (IA)3: ``<module>.weight`` beside an ``<module>.on_input`` flag (the reader
    names that weight's role ``ia3_weight``).
    """

    name = "ia3"
    patch = IA3
    roles = {"on_input": ("on_input",), "ia3_weight": ()}
    integer_roles = frozenset({"on_input"})

    def build(self, found: Found) -> list[Patch]:  # noqa: D102
        if not found.has("ia3_weight"):
            return []
        flag = materialize(found.get("on_input")).reshape(-1)
        if flag.numel() == 0:
            raise AdapterFormatError(
                f"{found.source}: {found.key('on_input')!r} is empty; it is corrupt")
        return [IA3("weight", weight=found.get("ia3_weight"), on_input=bool(flag[0].item()))]

    def spell(self, module: str, patch: IA3, to: str,  # type: ignore[override]
              tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # noqa: D102
        return {f"{module}.weight": tensors["weight"],
                f"{module}.on_input": torch.tensor(patch.on_input)}
