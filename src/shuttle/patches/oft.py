"""Diag-OFT (LyCORIS): an orthogonal rotation of the weight's output rows, block by block.

Shapes (k blocks of b rows, k * b = out):
    blocks   (k, b, b)       trained; only its skew-symmetric part Q = blocks - blocks^T counts
    rescale  (out, 1, ...)   optional per-row scale (LyCORIS ``rescaled``)

With ``c = alpha * out`` (the constraint; 0: none), ``Q <- Q * c / ||Q||`` when ``||Q|| > c``
(the norm over all blocks), and the Cayley transform ``R = (I + Q)(I - Q)^-1`` (orthogonal), row
block j of the weight becomes ``R_j^T W_j``. At strength m the rotation is
``I + m (R - I)`` and the row scale ``1 + m (rescale - 1)``: LyCORIS's merge at m = 1, the
weight itself at m = 0. (LyCORIS scales the rotation the same way but applies ``rescale``
whole at any multiplier.)
"""

from __future__ import annotations

import dataclasses
import math

import torch

from shuttle.errors import ShapeMismatchError, UnsupportedFormatError
from shuttle.patches.kind import Found, PatchKind, register_kind
from shuttle.patches.patch import Patch, Tensorish, materialize

__all__ = ["OFT", "OFTKind"]


@dataclasses.dataclass(frozen=True, eq=False)
class OFT(Patch):
    """Rotates blocks of output rows: ``W_j <- (I + m (R_j - I))^T W_j``, rows then rescaled.

    Attributes:
        blocks: (k, b, b) trained blocks (their skew-symmetric part is the generator).
        rescale: optional (out, 1, ...) row scales.
        alpha_value: the file's ``alpha`` (the constraint per output row; 0: unconstrained).
    """

    blocks: Tensorish
    rescale: Tensorish | None = None
    alpha_value: float | None = None
    tensor_fields = ("blocks", "rescale")
    additive = False  # the update R W - W depends on the weight it rotates

    @property
    def alpha(self) -> float | None:
        return self.alpha_value

    @property
    def out_rows(self) -> int | None:
        return self.blocks.shape[0] * self.blocks.shape[1]

    def check(self, shape: tuple[int, ...], name: str) -> None:
        shape = tuple(shape)
        rows = self.out_rows
        scales = math.prod(self.rescale.shape) if self.rescale is not None else rows
        if len(shape) < 2 or shape[0] != rows or scales != rows:
            raise ShapeMismatchError(
                f"oft patch for {name!r} rotates {rows} output rows (blocks "
                f"{tuple(self.blocks.shape)}, rescale "
                f"{tuple(self.rescale.shape) if self.rescale is not None else None}), but the "
                f"parameter has shape {shape}. The adapter was made for a different model (or "
                "layer); load it into the model it was trained for, or pass a key mapping.")

    def rotation(self, out: int) -> torch.Tensor:
        """The (k, b, b) Cayley rotations R, in float32 (``out``: the weight's rows, which
        the constraint is per).
        """
        blocks = materialize(self.blocks).float()
        q = blocks - blocks.transpose(1, 2)
        limit = (self.alpha_value or 0.0) * out
        if limit > 0:
            norm = torch.linalg.vector_norm(q) + 1e-8
            if norm > limit:
                q = q * (limit / norm)
        eye = torch.eye(q.shape[-1], device=q.device)
        return (eye + q) @ torch.linalg.inv(eye - q)

    def delta(self, shape: tuple[int, ...]) -> torch.Tensor:
        raise TypeError("an OFT delta depends on the weight; use apply()")

    def apply(self, weight: torch.Tensor, strength: float) -> torch.Tensor:
        k, b, _ = self.blocks.shape
        r = self.rotation(weight.shape[0]).to(weight.device)
        eye = torch.eye(b, device=r.device)
        m = eye + strength * (r - eye)
        w = weight.reshape(k, b, -1)
        out = torch.einsum("k n m, k n c -> k m c", m.to(weight.dtype), w)
        weight.copy_(out.reshape(weight.shape))
        if self.rescale is not None:
            s = materialize(self.rescale).to(weight.device, weight.dtype)
            weight.mul_(s.reshape(-1, *([1] * (weight.dim() - 1))).sub(1).mul(strength).add(1))
        return weight


@register_kind
class OFTKind(PatchKind):
    """LyCORIS diag-OFT: ``oft_blocks`` (k, b, b), an ``alpha`` (the constraint) and an
    optional ``rescale``. BOFT's butterfly blocks (4-D ``oft_blocks``) are refused.
    """

    name = "oft"
    patch = OFT
    roles = {"oft_blocks": ("oft_blocks",), "rescale": ("rescale",)}
    factor_roles = frozenset({"oft_blocks"})
    stage = "main"

    def build(self, found: Found) -> list[Patch]:  # noqa: D102
        found.need("oft_blocks")
        blocks = found.get("oft_blocks")
        if len(blocks.shape) != 3 or blocks.shape[1] != blocks.shape[2]:
            raise UnsupportedFormatError(
                f"{found.source}: {found.key('oft_blocks')!r} has shape {tuple(blocks.shape)}: "
                "LyCORIS BOFT (butterfly OFT, 4-D blocks) is not implemented yet; diag-OFT "
                "blocks are (k, b, b). Merge it with LyCORIS instead.")
        return [OFT("weight", blocks=blocks, rescale=found.get("rescale"),
                    alpha_value=found.alpha)]

    def spell(self, module: str, patch: Patch, to: str,  # noqa: D102
              tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        assert isinstance(patch, OFT)
        alpha = torch.tensor(patch.alpha_value or 0.0, dtype=torch.float64)
        return {**{f"{module}.{'oft_blocks' if k == 'blocks' else k}": v
                   for k, v in tensors.items()}, f"{module}.alpha": alpha}
