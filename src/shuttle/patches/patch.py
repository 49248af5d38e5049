"""The :class:`Patch` base: one update to one parameter, declared by its tensors.

A patch never reads files and never knows module names. Its tensors are either real tensors or
:class:`TensorRef` placeholders (shape and dtype known from a file header, data read on
:meth:`Patch.load`), so an adapter can be inspected and validated without reading its data.

Every patch kind declares its tensor fields once in ``tensor_fields``; loading, moving, byte counts
and descriptions are derived from that list. What a kind is beyond its math (its roles in files,
construction, spelling, dynamic form) is its :class:`~shuttle.patches.kind.PatchKind`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import torch

from shuttle.errors import ShapeMismatchError

__all__ = ["Patch", "TensorRef", "materialize"]


@runtime_checkable
class TensorRef(Protocol):
    """A tensor whose shape and dtype are known before its data is read."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def load(self) -> torch.Tensor:
        """Read the tensor's data."""
        ...


Tensorish = torch.Tensor | TensorRef


def materialize(t: Tensorish) -> torch.Tensor:
    """Return ``t`` as a real tensor, reading it if it is a :class:`TensorRef`."""
    return t if isinstance(t, torch.Tensor) else t.load()


_PatchT = TypeVar("_PatchT", bound="Patch")


@dataclasses.dataclass(frozen=True, eq=False)
class Patch:
    """One update of one parameter of a module.

    Attributes:
        param: the parameter of the target module this patch changes (``"weight"``, ``"bias"``,
            or another parameter name such as ``"scale"``).
    """

    param: str
    kind: ClassVar[str] = "patch"
    # Names of the dataclass fields that hold tensors (None allowed for optional ones).
    tensor_fields: ClassVar[tuple[str, ...]] = ()
    # True when apply(w, m) == w + m * delta(w) with delta independent of w: such patches
    # can be summed in any order and applied in a dynamic forward as a residual.
    additive: ClassVar[bool] = True

    # -- derived from tensor_fields ---------------------------------------------------------
    def tensors(self) -> Iterator[tuple[str, Tensorish]]:
        """Yield ``(field, tensor)`` for every tensor the patch holds."""
        for name in self.tensor_fields:
            t = getattr(self, name)
            if t is not None:
                yield name, t

    @property
    def nbytes(self) -> int:
        """Bytes of the patch's tensors in their stored dtype."""
        return sum(
            math.prod(t.shape) * _itemsize(t.dtype) for _, t in self.tensors()
        )

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the patch's tensors (the first one's, as adapters use one dtype)."""
        return next(t.dtype for _, t in self.tensors())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each tensor field."""
        return {name: tuple(t.shape) for name, t in self.tensors()}

    def load(self: _PatchT, device: torch.device | str | None = None) -> _PatchT:
        """Return this patch with every tensor read (and moved to ``device`` if given).

        A patch whose tensors are all real and already there is returned as is.
        """
        changes: dict[str, Any] = {}
        for name, t in self.tensors():
            real = materialize(t)
            if device is not None:
                real = real.to(device, non_blocking=True)
            if real is not t:
                changes[name] = real
        return dataclasses.replace(self, **changes) if changes else self

    # -- per kind ---------------------------------------------------------------------------
    @property
    def rank(self) -> int | None:
        """The rank of a low-rank kind, else None."""
        return None

    @property
    def alpha(self) -> float | None:
        """The alpha the scale was derived from, where the kind has one."""
        return None

    @property
    def out_rows(self) -> int | None:
        """Leading dimension of the parameter this patch fits, when the tensors tell it."""
        return None

    @property
    def in_columns(self) -> int | None:
        """Columns (input features) of the 2-D weight this patch fits, when the tensors tell it;
        a control LoRA's ``img_in`` has more than the model's layer (see ``apply.widen``).
        """
        return None

    def check(self, shape: torch.Size | tuple[int, ...], name: str) -> None:
        """Raise :class:`ShapeMismatchError` unless this patch fits a parameter of ``shape``.

        Uses tensor shapes only: nothing is read.
        """
        raise NotImplementedError

    def delta(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """The update in float32, shaped like the parameter, before strength."""
        raise NotImplementedError

    def apply(self, weight: torch.Tensor, strength: float) -> torch.Tensor:
        """Return the float32 parameter after this patch at ``strength`` (may reuse ``weight``).

        Args:
            weight: the current float32 parameter value; it may be updated in place.
            strength: the user's multiplier, finite.
        """
        return weight.add_(self.delta(weight.shape), alpha=strength)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def expect_numel(
    patch: Patch, shape: tuple[int, ...], name: str, numel: int, out: int | None
) -> None:
    """Shared shape check: the update has ``numel`` elements and ``out`` leading rows."""
    if math.prod(shape) != numel or (out is not None and len(shape) and shape[0] != out):
        raise ShapeMismatchError(
            f"{patch.kind} patch for {name!r} has tensors {patch.shapes()}, giving an update of "
            f"{numel} elements with {out} output rows, but the parameter has shape "
            f"{tuple(shape)}. The adapter was made for a different model (or layer); check that "
            "you load it into the model it was trained for, or pass a key mapping."
        )
