"""OFT (LyCORIS diag-OFT and BOFT): orthogonal rotations of the weight's output rows.

Shapes (k blocks of b rows, k * b = out):
    blocks   (k, b, b)       diag-OFT; only the skew-symmetric part Q = blocks - blocks^T counts
             (s, k, b, b)    BOFT: s butterfly stages of k blocks each
    rescale  (out, 1, ...)   optional per-row scale (LyCORIS ``rescaled``)

With ``c = alpha * out`` (the constraint; 0: none), ``Q <- Q * c / ||Q||`` when ``||Q|| > c``
(the norm over all blocks), and the Cayley transform ``R = (I + Q)(I - Q)^-1`` (orthogonal), row
block j of the weight becomes ``R_j^T W_j``. At strength m the rotation is
``I + m (R - I)`` and the row scale ``1 + m (rescale - 1)``: LyCORIS's merge at m = 1, the
weight itself at m = 0. (LyCORIS scales the rotation the same way but applies ``rescale``
whole at any multiplier.)

BOFT applies its stages in turn, each to the whole weight: stage i pairs rows 2^i * b / 2 apart
(the rows viewed (-1, 2, 2^i * b / 2) with the last two axes swapped, then cut in blocks of b),
and block j of the stage becomes ``(I + m (R_ij - I)) W_j`` (R itself, not its transpose: each
tool's own convention). The constraint bounds the norm over all stages' generators.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from shuttle.errors import AdapterFormatError, ShapeMismatchError
from shuttle.patches.kind import Found, PatchKind, register_kind
from shuttle.patches.patch import Patch, Tensorish, materialize

__all__ = ["OFT", "OFTKind"]


@dataclasses.dataclass(frozen=True, eq=False)
class OFT(Patch):
    """Rotates blocks of output rows (diag-OFT: ``W_j <- (I + m (R_j - I))^T W_j``; BOFT: its
    stages in turn), rows then rescaled.

    Attributes:
        blocks: (k, b, b) diag-OFT or (s, k, b, b) BOFT trained blocks (their skew-symmetric
            part is the generator).
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
        return self.blocks.shape[-3] * self.blocks.shape[-2]

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
        """The ([s,] k, b, b) Cayley rotations R, in float32 (``out``: the weight's rows,
        which the constraint is per).
        """
        blocks = materialize(self.blocks).float()
        q = blocks - blocks.transpose(-1, -2)
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
        b = self.blocks.shape[-1]
        r = self.rotation(weight.shape[0]).to(weight.device)
        eye = torch.eye(b, device=r.device)
        m = (eye + strength * (r - eye)).to(weight.dtype)
        w = weight.reshape(weight.shape[0], -1)
        if m.dim() == 3:  # diag-OFT: row block j becomes M_j^T W_j
            k = m.shape[0]
            w = torch.einsum("k n m, k n c -> k m c", m, w.reshape(k, b, -1))
        for i, stage in enumerate(m if m.dim() == 4 else ()):  # BOFT: M_ij W_j, stage by stage
            half = 2 ** i * b // 2
            w = w.unflatten(0, (-1, 2, half)).transpose(1, 2).reshape(-1, b, w.shape[-1])
            w = torch.einsum("k i j, k j c -> k i c", stage, w)
            w = w.reshape(-1, half, 2, w.shape[-1]).transpose(1, 2).reshape(-1, w.shape[-1])
        weight.copy_(w.reshape(weight.shape))
        if self.rescale is not None:
            s = materialize(self.rescale).to(weight.device, weight.dtype)
            weight.mul_(s.reshape(-1, *([1] * (weight.dim() - 1))).sub(1).mul(strength).add(1))
        return weight


@register_kind
class OFTKind(PatchKind):
    """LyCORIS diag-OFT (``oft_blocks`` (k, b, b)) and BOFT ((s, k, b, b)), with an
    ``alpha`` (the constraint) and an optional ``rescale``.
    """

    name = "oft"
    patch = OFT
    roles = {"oft_blocks": ("oft_blocks",), "rescale": ("rescale",)}
    factor_roles = frozenset({"oft_blocks"})
    stage = "main"

    def build(self, found: Found) -> list[Patch]:  # noqa: D102
        found.need("oft_blocks")
        blocks = found.get("oft_blocks")
        shape = tuple(blocks.shape)
        b = shape[-1]
        # BOFT's last stage pairs rows 2^(s-1) * b / 2 apart: k blocks must hold 2^(s-1) pairs
        stages_fit = len(shape) == 3 or (b % 2 == 0 and shape[1] % 2 ** (shape[0] - 1) == 0)
        if len(shape) not in (3, 4) or shape[-2] != b or not stages_fit:
            raise AdapterFormatError(
                f"{found.source}: {found.key('oft_blocks')!r} has shape {shape}; OFT blocks are "
                "(blocks, b, b) (diag-OFT) or (stages, blocks, b, b) with b even and the "
                "blocks a multiple of 2^(stages - 1) (BOFT). The file is corrupt; export it "
                "again.")
        return [OFT("weight", blocks=blocks, rescale=found.get("rescale"),
                    alpha_value=found.alpha)]

    def spell(self, module: str, patch: Patch, to: str,  # noqa: D102
              tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        assert isinstance(patch, OFT)
        alpha = torch.tensor(patch.alpha_value or 0.0, dtype=torch.float64)
        return {**{f"{module}.{'oft_blocks' if k == 'blocks' else k}": v
                   for k, v in tensors.items()}, f"{module}.alpha": alpha}
