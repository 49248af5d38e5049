"""Dense payloads: an additive ``Diff`` and a replacing ``Set``.

``Diff`` covers LyCORIS full (``diff``/``diff_b``), norm (``w_norm``/``b_norm``), ComfyUI
``.diff``/``.diff_b`` and PEFT's ``lora_B.bias``. ``Set`` covers ``.set_weight`` and the BFL
control LoRA's norm scales: the parameter becomes ``strength * value``, an interpolation from zero.
"""

from __future__ import annotations

import dataclasses

import torch

from shuttle.errors import ShapeMismatchError, UnsupportedFormatError
from shuttle.patches.kind import Found, PatchKind, register_kind
from shuttle.patches.patch import Patch, Tensorish, materialize

__all__ = ["Diff", "DiffKind", "Set", "SetKind"]


def _check_exact(patch: Patch, t: Tensorish, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ShapeMismatchError(
            f"{patch.kind} patch for {name!r} has shape {tuple(t.shape)} but the parameter has "
            f"shape {tuple(shape)}. Dense payloads must match exactly; load the adapter into the "
            "model it was made for."
        )


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


# role -> the parameter its diff updates (LyCORIS full and norm, ComfyUI .diff/.diff_b)
_DIFF_ROLES = {"diff": "weight", "w_norm": "weight", "diff_b": "bias", "b_norm": "bias"}


@register_kind
class DiffKind(PatchKind):
    """Dense deltas: LyCORIS full/norm, ComfyUI ``.diff``/``.diff_b``, PEFT's ``lora_B.bias``
    (a bias delta at the module's LoRA scale).
    """

    name = "diff"
    patch = Diff
    payload = True
    roles = {"up_bias": ("lora_B.bias", "lora_B.default.bias", "lora_up.bias"),
             **{r: (r,) for r in _DIFF_ROLES}}

    def build(self, found: Found) -> list[Patch]:  # noqa: D102
        out: list[Patch] = []
        if found.has("up_bias"):
            # PEFT scales lora_B.bias by the LoRA's scale (that of a DoRA's inner patch)
            main = getattr(found.main, "inner", found.main)
            out.append(Diff("bias", diff=found.get("up_bias"),
                            scale=getattr(main, "scale", 1.0)))
        out += [Diff(param, diff=found.get(role)) for role, param in _DIFF_ROLES.items()
                if found.has(role)]
        return out

    def spell(self, module: str, patch: Diff, to: str,  # type: ignore[override]
              tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # noqa: D102
        if patch.scale != 1.0:
            raise UnsupportedFormatError(
                f"module {module!r}: a scaled bias delta ({patch.scale}) has no {to} spelling; "
                "convert to peft instead."
            )
        suffix = {"weight": "diff", "bias": "diff_b"}.get(patch.param)
        if suffix is None:
            raise UnsupportedFormatError(f"module {module!r}: diff of {patch.param!r} has no "
                                         f"{to} spelling")
        return {f"{module}.{suffix}": tensors["diff"]}


@register_kind
class SetKind(PatchKind):
    """Whole values: ``.set_weight`` (ComfyUI) and the BFL control LoRA's norm scales."""

    name = "set"
    patch = Set
    # BFL control LoRA: RMSNorm scales replaced whole (ComfyUI turns them into set_weight);
    # the module keeps the "query_norm"/"key_norm" part (formats.roles.split_key).
    roles = {"set_weight": ("set_weight",), "norm_scale": ("query_norm.scale", "key_norm.scale")}
    integer_roles = frozenset({"set_weight"})  # an integer buffer's value
    replaces = True
    payload = True

    def build(self, found: Found) -> list[Patch]:  # noqa: D102
        out: list[Patch] = []
        if found.has("set_weight"):
            out.append(Set("weight", value=found.get("set_weight")))
        if found.has("norm_scale"):
            out.append(Set("scale", value=found.get("norm_scale")))
        return out

    def spell(self, module: str, patch: Set, to: str,  # type: ignore[override]
              tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # noqa: D102
        if patch.param == "weight":
            return {f"{module}.set_weight": tensors["value"]}
        if to == "kohya":
            raise UnsupportedFormatError(f"module {module!r}: set of {patch.param!r} has no "
                                         "kohya spelling; convert to comfy instead.")
        return {f"{module}.{patch.param}.set_weight": tensors["value"]}
