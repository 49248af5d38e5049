"""LoHa (LyCORIS): ``delta = scale * (w1a @ w1b) * (w2a @ w2b)`` (Hadamard product).

Shapes (r = rank): w1a, w2a (out, r); w1b, w2b (r, in * k...). With Tucker cores t1, t2
(r, r, k...) the factors are ``einsum("i j ..., i p, j q -> p q ...", t, wa, wb)`` with wa (r, out)
and wb (r, in), as LyCORIS rebuilds them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from shuttle.errors import AdapterFormatError, ShapeMismatchError
from shuttle.patches.kind import Found, PatchKind, alpha_tensor, register_kind
from shuttle.patches.patch import Patch, Tensorish, expect_numel, materialize

__all__ = ["LoHa", "LoHaKind", "rebuild_tucker"]


def rebuild_tucker(t: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """Tucker product: t (r1, r2, k...), wa (r1, out), wb (r2, in) -> (out, in, k...)."""
    return torch.einsum("i j ..., i p, j q -> p q ...", t, wa, wb)


@dataclasses.dataclass(frozen=True, eq=False)
class LoHa(Patch):
    """Hadamard product of two low-rank products, times ``scale``."""

    w1a: Tensorish
    w1b: Tensorish
    w2a: Tensorish
    w2b: Tensorish
    t1: Tensorish | None = None
    t2: Tensorish | None = None
    scale: float = 1.0
    alpha_value: float | None = None
    tensor_fields = ("w1a", "w1b", "w2a", "w2b", "t1", "t2")

    def __post_init__(self) -> None:
        if (self.t1 is None) != (self.t2 is None):
            raise AdapterFormatError(
                f"loha patch for {self.param!r} has one Tucker core of two ({self.shapes()}); "
                "the Tucker form needs both hada_t1 and hada_t2. The file is corrupt; export it "
                "again."
            )

    @property
    def rank(self) -> int:
        return self.w1b.shape[0]

    @property
    def alpha(self) -> float | None:
        return self.alpha_value

    def _out_in(self) -> tuple[int, int]:
        if self.t1 is not None:
            return self.w1a.shape[1], self.w1b.shape[1] * math.prod(self.t1.shape[2:])
        return self.w1a.shape[0], math.prod(self.w1b.shape[1:])

    @property
    def out_rows(self) -> int:
        return self._out_in()[0]

    def check(self, shape: tuple[int, ...], name: str) -> None:
        def product(wa: Tensorish, wb: Tensorish, t: Tensorish | None) -> tuple[int, ...] | None:
            if t is None:  # wa (out, r) @ wb (r, in...)
                ok = math.prod(wa.shape[1:]) == wb.shape[0]
                return (wa.shape[0], math.prod(wb.shape[1:])) if ok else None
            ok = tuple(t.shape[:2]) == (wa.shape[0], wb.shape[0])  # Tucker: wa (r1, out)...
            return (wa.shape[1], wb.shape[1], *t.shape[2:]) if ok else None

        f1, f2 = product(self.w1a, self.w1b, self.t1), product(self.w2a, self.w2b, self.t2)
        if f1 is None or f1 != f2:
            raise ShapeMismatchError(
                f"loha patch for {name!r} has tensors {self.shapes()} that do not form two "
                "products of one shape. The file is corrupt; export it again."
            )
        out, inn = self._out_in()
        expect_numel(self, tuple(shape), name, out * inn, out)

    def delta(self, shape: tuple[int, ...]) -> torch.Tensor:
        w1a, w1b, w2a, w2b = (materialize(t).float() for t in (self.w1a, self.w1b, self.w2a,
                                                               self.w2b))
        if self.t1 is not None:
            f1 = rebuild_tucker(materialize(self.t1).float(), w1a, w1b)
            f2 = rebuild_tucker(materialize(self.t2).float(), w2a, w2b)
        else:
            f1 = w1a.flatten(1) @ w1b.flatten(1)
            f2 = w2a.flatten(1) @ w2b.flatten(1)
        return f1.mul_(f2).mul_(self.scale).reshape(shape)


# role (and key suffix) of each LoHa field
_HADA = {"w1a": "hada_w1_a", "w1b": "hada_w1_b", "w2a": "hada_w2_a", "w2b": "hada_w2_b",
         "t1": "hada_t1", "t2": "hada_t2"}


@register_kind
class LoHaKind(PatchKind):
    """LyCORIS LoHa: ``hada_*`` factors and an alpha."""

    name = "loha"
    patch = LoHa
    roles = {r: (r, f"{r}.default", f"{r}.weight") for r in _HADA.values()}
    factor_roles = frozenset(roles)
    stage = "main"

    def build(self, found: Found) -> list[Patch]:  # noqa: D102
        found.need("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
        return [LoHa("weight", **{f: found.get(r) for f, r in _HADA.items()},
                     scale=found.scale(found.get("hada_w1_b").shape[0]),
                     alpha_value=found.alpha)]

    def spell(self, module: str, patch: Patch, to: str,
              tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # noqa: D102
        return {**{f"{module}.{_HADA[k]}": v for k, v in tensors.items()},
                f"{module}.alpha": alpha_tensor(patch)}
