"""LoKr (LyCORIS): ``delta = scale * kron(w1, w2)`` reshaped to the weight.

w1 is ``lokr_w1`` (a, b) or ``lokr_w1_a @ lokr_w1_b``; w2 is ``lokr_w2`` (c, d[, k...]),
``lokr_w2_a @ lokr_w2_b`` (c, d * k...), or the Tucker form
``einsum("i j ..., i p, j q -> p q ...", lokr_t2, w2a, w2b)``. The product has a*c rows and
b*d*k... columns. A 2-D kron reshaped equals the 4-D kron of the conv layout, since row-major
flattening of (b*d, k...) matches the 2-D column index.

LyCORIS unsqueezes w1 to w2's dimensions before the kron (``w1[:, :, None, ...]``). PEFT does so
for a 4-D w2 only: for a Conv1d with a full 3-D ``lokr_w2`` (c, d, k) its ``make_kron`` takes
``kron(w1 (a, b), w2)``, which torch computes as ``kron(w1[None], w2)`` of shape (c, a*d, b*k),
and reshapes that to the weight's (a*c, b*d, k): another placement of the same products.
``layout="peft"`` (set for files PEFT wrote) follows it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

from shuttle.errors import AdapterFormatError, ShapeMismatchError, UnsupportedFormatError
from shuttle.patches.kind import Found, PatchKind, alpha_tensor, register_kind
from shuttle.patches.loha import rebuild_tucker
from shuttle.patches.patch import Patch, Tensorish, expect_numel, materialize

__all__ = ["LoKr", "LoKrKind"]


@dataclasses.dataclass(frozen=True, eq=False)
class LoKr(Patch):
    """Kronecker product of two (possibly low-rank) factors, times ``scale``.

    ``layout``: ``"lycoris"`` (w1 unsqueezed to w2's dimensions), or ``"peft"`` (PEFT's
    ``make_kron``, which differs for a 3-D w2 only).
    """

    w1: Tensorish | None = None
    w1a: Tensorish | None = None
    w1b: Tensorish | None = None
    w2: Tensorish | None = None
    w2a: Tensorish | None = None
    w2b: Tensorish | None = None
    t2: Tensorish | None = None
    scale: float = 1.0
    alpha_value: float | None = None
    layout: Literal["lycoris", "peft"] = "lycoris"
    tensor_fields = ("w1", "w1a", "w1b", "w2", "w2a", "w2b", "t2")

    def __post_init__(self) -> None:
        for n in ("1", "2"):
            full, a, b = (getattr(self, f"w{n}{s}") for s in ("", "a", "b"))
            if (full is None) == (a is None or b is None) or (a is None) != (b is None):
                raise AdapterFormatError(
                    f"lokr patch for {self.param!r} needs lokr_w{n}, or lokr_w{n}_a with "
                    f"lokr_w{n}_b, and not both; it has {self.shapes()}. The file is corrupt; "
                    "export it again."
                )
        if self.layout not in ("lycoris", "peft"):
            raise AdapterFormatError(
                f"unknown LoKr layout {self.layout!r}; use 'lycoris' or 'peft'")

    @property
    def peft_layout(self) -> bool:
        """Whether the product is placed as PEFT places it and LyCORIS does not (3-D w2)."""
        return self.layout == "peft" and self.w2 is not None and len(self.w2.shape) == 3

    @property
    def rank(self) -> int | None:
        if self.w1b is not None:
            return self.w1b.shape[0]
        if self.w2b is not None:
            return self.w2b.shape[0]
        return None

    @property
    def alpha(self) -> float | None:
        return self.alpha_value

    def _w1_shape(self) -> tuple[int, int]:
        if self.w1 is not None:
            return self.w1.shape[0], math.prod(self.w1.shape[1:])
        return self.w1a.shape[0], math.prod(self.w1b.shape[1:])

    def _w2_shape(self) -> tuple[int, int]:
        if self.w2 is not None:
            return self.w2.shape[0], math.prod(self.w2.shape[1:])
        if self.t2 is not None:
            return self.w2a.shape[1], self.w2b.shape[1] * math.prod(self.t2.shape[2:])
        return self.w2a.shape[0], math.prod(self.w2b.shape[1:])

    def check(self, shape: tuple[int, ...], name: str) -> None:
        # w1a (a, r) @ w1b (r, b); w2a (c, r) @ w2b (r, d...), or Tucker t2 (r1, r2, k...)
        # with w2a (r1, c) and w2b (r2, d).
        pairs = [] if self.w1 is not None else [(math.prod(self.w1a.shape[1:]),
                                                 self.w1b.shape[0])]
        if self.t2 is not None:
            pairs.append((tuple(self.t2.shape[:2]), (self.w2a.shape[0], self.w2b.shape[0])))
        elif self.w2 is None:
            pairs.append((math.prod(self.w2a.shape[1:]), self.w2b.shape[0]))
        if any(x != y for x, y in pairs):
            raise ShapeMismatchError(
                f"lokr patch for {name!r} has tensors {self.shapes()} whose rank dimensions "
                "differ, so they do not multiply. The file is corrupt; export it again."
            )
        (a, b), (c, d) = self._w1_shape(), self._w2_shape()
        expect_numel(self, tuple(shape), name, a * b * c * d, a * c)

    @property
    def out_rows(self) -> int:
        return self._w1_shape()[0] * self._w2_shape()[0]

    def delta(self, shape: tuple[int, ...]) -> torch.Tensor:
        def f(t: Tensorish | None) -> torch.Tensor | None:
            return None if t is None else materialize(t).float()

        w1 = f(self.w1) if self.w1 is not None else f(self.w1a).flatten(1) @ f(self.w1b).flatten(1)
        if self.w2 is not None:
            w2 = f(self.w2)
        elif self.t2 is not None:
            w2 = rebuild_tucker(f(self.t2), f(self.w2a), f(self.w2b))
        else:
            w2 = f(self.w2a).flatten(1) @ f(self.w2b).flatten(1)
        w1 = w1.reshape(w1.shape[0], -1)
        if self.peft_layout:
            # (a, b) kron (c, d, k) = (1, a, b) kron (c, d, k): (c, a*d, b*k), then reshaped
            return torch.kron(w1[None].contiguous(), w2.contiguous()).mul_(self.scale) \
                .reshape(shape)
        w1 = w1.reshape(*w1.shape, *([1] * (w2.dim() - 2)))
        # torch.kron fails on non-contiguous inputs (the Tucker einsum gives a permuted view)
        return torch.kron(w1.contiguous(), w2.contiguous()).mul_(self.scale).reshape(shape)


# role (and key suffix) of each LoKr field
_LOKR = {f: f"lokr_{f[:2]}{'_' + f[2] if len(f) == 3 else ''}"
         for f in ("w1", "w1a", "w1b", "w2", "w2a", "w2b", "t2")}


@register_kind
class LoKrKind(PatchKind):
    """LyCORIS (and PEFT) LoKr: ``lokr_*`` factors and an alpha."""

    name = "lokr"
    patch = LoKr
    roles = {r: (r, f"{r}.default", f"{r}.weight") for r in _LOKR.values()}
    factor_roles = frozenset(roles)
    stage = "main"

    def build(self, found: Found) -> list[Patch]:  # noqa: D102
        if not found.has("lokr_w1"):
            found.need("lokr_w1_a", "lokr_w1_b")
        if not found.has("lokr_w2"):
            found.need("lokr_w2_a", "lokr_w2_b")
        b = found.get("lokr_w1_b") if found.has("lokr_w1_b") else found.get("lokr_w2_b")
        rank = b.shape[0] if b is not None else None  # both factors full: no rank
        return [LoKr("weight", **{f: found.get(r) for f, r in _LOKR.items()},
                     scale=found.scale(rank), alpha_value=found.alpha,
                     layout=found.fmt.lokr_layout if found.fmt is not None else "lycoris")]

    def spell(self, module: str, patch: LoKr, to: str,  # type: ignore[override]
              tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # noqa: D102
        if patch.peft_layout:
            raise UnsupportedFormatError(
                f"module {module!r}: a PEFT LoKr with a full 3-D lokr_w2 (Conv1d) places its "
                f"Kronecker product as PEFT does, which {to} readers do not; keep the PEFT file."
            )
        if patch.rank is None and patch.scale != 1.0:
            raise UnsupportedFormatError(
                f"module {module!r}: a LoKr with two full factors and scale {patch.scale} "
                f"(PEFT's convention) cannot be written as {to}, whose readers force scale 1 "
                "there."
            )
        return {**{f"{module}.{_LOKR[k]}": v for k, v in tensors.items()},
                f"{module}.alpha": alpha_tensor(patch)}
