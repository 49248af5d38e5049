"""Low-rank patches: ``delta = scale * up @ down`` (LoRA, LoCon, Tucker ``mid``, embeddings).

Shapes (r = rank):
    up    (out, r[, 1, ...])       also called B or ``lora_up``
    down  (r, in[, k, ...])        also called A or ``lora_down``
    mid   (r, r, k, ...)           optional Tucker core; then down is (r, in, 1, ...)

The flattened product ``up.flatten(1) @ down.flatten(1)`` reshaped to the weight is the delta of a
Linear weight, and of a Conv weight whose ``down`` carries the kernel (LoCon). With ``transposed``
the delta is ``(up @ down).T``: PEFT's embedding factors and ``fan_in_fan_out`` Conv1D layers.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cached_property

import torch
import torch.nn.functional as F

from shuttle.errors import NonFiniteAdapterError, ShapeMismatchError, UnsupportedFormatError
from shuttle.patches.kind import Found, PatchKind, alpha_tensor, register_kind
from shuttle.patches.patch import Patch, Tensorish, expect_numel, materialize

__all__ = ["LowRank", "LowRankKind", "split_blocks"]


@dataclasses.dataclass(frozen=True, eq=False)
class LowRank(Patch):
    """``scale * up @ down`` (Tucker form with ``mid``), optionally transposed.

    Attributes:
        up: (out, r, ...) factor.
        down: (r, in, ...) factor.
        mid: optional (r, r, k, ...) Tucker core.
        scale: alpha / rank (or alpha / sqrt(rank) for rsLoRA), decided by the format reader.
        alpha_value: the alpha stored in the file or config, for reports (None when absent).
        transposed: the delta is ``(up @ down).T`` (PEFT embeddings, ``fan_in_fan_out``).
        split_qkv: the file may be a kohya Flux split-qkv save: ``down`` concatenates the
            downs of n splits and ``up`` is block diagonal, while ``alpha`` was left as the
            alpha of one split. When the zeros confirm it, the scale is multiplied by n.
    """

    up: Tensorish
    down: Tensorish
    mid: Tensorish | None = None
    scale: float = 1.0
    alpha_value: float | None = None
    transposed: bool = False
    split_qkv: bool = False
    scale_source: Tensorish | None = None  # the whole up when this patch is rows of a split save
    tensor_fields = ("up", "down", "mid")

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def alpha(self) -> float | None:
        return self.alpha_value

    @property
    def out_features(self) -> int:
        """Rows of the (untransposed) delta."""
        return self.up.shape[0]

    @property
    def out_rows(self) -> int:
        return self.in_numel if self.transposed else self.out_features

    @property
    def in_columns(self) -> int | None:
        plain = self.mid is None and not self.transposed and len(self.down.shape) == 2
        return self.down.shape[1] if plain else None

    @property
    def in_numel(self) -> int:
        """Columns of the flattened delta: inputs times kernel size."""
        n = math.prod(self.down.shape[1:])
        if self.mid is not None:
            n *= math.prod(self.mid.shape[2:])
        return n

    def check(self, shape: tuple[int, ...], name: str) -> None:
        shape = tuple(shape)
        # up (out, r1), mid (r1, r2, k...), down (r2, in...): each inner size must match.
        r_up = math.prod(self.up.shape[1:])
        chain = [r_up, self.rank] if self.mid is None else [r_up, *self.mid.shape[:2], self.rank]
        if chain[0::2] != chain[1::2]:
            raise ShapeMismatchError(
                f"lora patch for {name!r} has tensors {self.shapes()} whose rank dimensions "
                "differ, so they do not multiply. The file is corrupt; export it again."
            )
        numel = self.out_features * self.in_numel
        if self.transposed:
            expect_numel(self, shape, name, numel, out=self.in_numel if self.mid is None else None)
        else:
            expect_numel(self, shape, name, numel, out=self.out_features)

    @cached_property
    def effective_scale(self) -> float:
        """``scale``, times n for a confirmed n-way split-qkv save (reads ``up``)."""
        if not self.split_qkv:
            return self.scale
        up = self.scale_source if self.scale_source is not None else self.up
        return self.scale * len(split_blocks(materialize(up).flatten(1), self.rank))

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(up2d, down2d)`` with ``up2d @ down2d`` the flattened delta before scale.

        up2d is (out, r) in the file's dtype; down2d is (r, in * k...), in the file's dtype,
        or with a Tucker core the float32 fold of the core into it.
        """
        up = materialize(self.up).flatten(1)
        down = materialize(self.down).flatten(1)
        if self.mid is not None:
            mid = materialize(self.mid)
            # mid: (r_up, r_down, *k); fold the core into down: (r_up, in, *k) -> (r_up, in*k).
            # The fold stays float32: rounding it to a float16 file's dtype would be a second
            # rounding (about 3e-4 of the update off, against 1e-7 for the float32 fold).
            down = torch.einsum("i j ..., j n -> i n ...", mid.float(), down.float()).flatten(1)
        return up, down

    def delta(self, shape: tuple[int, ...]) -> torch.Tensor:
        up, down = self.factors()
        d = up.float() @ down.float()
        if self.transposed:
            d = d.T
        return d.mul_(self.effective_scale).reshape(shape)

    def apply(self, weight: torch.Tensor, strength: float) -> torch.Tensor:
        if self.transposed or self.mid is not None:
            return weight.add_(self.delta(weight.shape), alpha=strength)
        alpha = strength * self.effective_scale
        limit = torch.finfo(weight.dtype).max
        if not abs(alpha) <= limit:  # addmm_ would raise a bare RuntimeError
            raise NonFiniteAdapterError(
                f"lora patch: strength {strength:.4g} times the adapter's scale "
                f"{self.effective_scale:.4g} (alpha {self.alpha_value} / rank {self.rank}) is "
                f"{alpha:.4g}, beyond {str(weight.dtype).removeprefix('torch.')}'s range "
                f"({limit:.4g}); lower the strength, or export the adapter again if its alpha "
                "is corrupt."
            )
        up, down = self.factors()
        # One fused multiply-add into the float32 (or float64) weight: w += (m * s) * up @ down.
        w2d = weight.view(weight.shape[0], -1)
        w2d.addmm_(up.to(weight.dtype), down.to(weight.dtype),
                   alpha=alpha)
        return weight

    def residual(self, x: torch.Tensor, layer: torch.nn.Module,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
        """``scale * up(down(x))`` computed through the layer's own op, before strength.

        Supports Linear (and transposed Conv1D-style), Conv1d/2d/3d and Embedding layers.

        Args:
            x: the layer's input (an Embedding's: indices).
            layer: the layer.
            dtype: the dtype the chain runs in and returns (activations and factors are cast
                to it). Default: the promotion of ``x``'s dtype (an Embedding's weight's) and
                the factors' dtypes, so neither is narrowed: an fp16 file on a float32 or bf16
                layer runs in float32.
        """
        tensors = [materialize(t) for t in (self.up, self.down, self.mid) if t is not None]
        if dtype is None:
            dtype = x.dtype if x.is_floating_point() else layer.weight.dtype
            for t in tensors:
                dtype = torch.promote_types(dtype, t.dtype)
        up, down, *mid = (t.to(dtype) for t in tensors)
        s = self.effective_scale
        if isinstance(layer, torch.nn.Embedding):
            # delta^T = down^T up^T: (vocab, r) @ (r, dim)
            h = F.embedding(x, down.T, layer.padding_idx)
            return (h @ up.T) * s
        x = x.to(dtype)
        if isinstance(layer, torch.nn.modules.conv._ConvNd):
            spatial = layer.weight.dim() - 2
            conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spatial]
            if self.mid is None:
                k = down.reshape(down.shape[0], layer.in_channels, *layer.kernel_size)
                h = conv(x, k, None, layer.stride, layer.padding, layer.dilation)
            else:
                d = down.reshape(down.shape[0], layer.in_channels, *([1] * spatial))
                h = conv(conv(x, d), mid[0], None, layer.stride, layer.padding, layer.dilation)
            u = up.reshape(up.shape[0], up.shape[1], *([1] * spatial))
            return conv(h, u) * s
        return F.linear(F.linear(x, down.flatten(1)), up.flatten(1)) * s


def split_blocks(up: torch.Tensor, rank: int) -> list[tuple[int, int]]:
    """Row ranges of a block-diagonal ``up`` (out, rank) made of n column groups, or one range.

    kohya's Flux trainer with ``split_qkv`` saves q, k, v (and the single blocks' MLP) LoRAs as
    one: downs concatenated to rank n*r and ups placed on the block diagonal. The column groups
    are found from the zeros: group j (columns j*r/n ... (j+1)*r/n) must be non-zero on exactly
    one contiguous row range, the ranges ordered and tiling all rows. Anything else is an
    ordinary LoRA of rank ``rank`` and gives ``[(0, out)]``.
    """
    out = up.shape[0]
    for n in (3, 4, 2):
        if rank % n:
            continue
        r = rank // n
        ranges: list[tuple[int, int]] = []
        start = 0
        for j in range(n):
            rows = up[:, j * r:(j + 1) * r].ne(0).any(dim=1).nonzero().flatten()
            if rows.numel() == 0 or rows[0].item() != start:
                break
            end = int(rows[-1].item()) + 1
            if up[start:end, :j * r].any() or up[start:end, (j + 1) * r:].any():
                break
            ranges.append((start, end))
            start = end
        if len(ranges) == n and start == out:
            return ranges
    return [(0, out)]


@register_kind
class LowRankKind(PatchKind):
    """LoRA/LoCon/Tucker (``up``/``down``/``mid``) and PEFT embedding factors, in every
    tool's spelling; the low-rank residual of a dynamic forward.
    """

    name = "lora"
    patch = LowRank
    roles = {
        "up": ("lora_up.weight", "lora_B.weight", "lora_B.default.weight", "lora_B.default",
               "lora_B", "lora.up.weight", "_lora.up.weight", "lora_linear_layer.up.weight"),
        "down": ("lora_down.weight", "lora_A.weight", "lora_A.default.weight",
                 "lora_A.default", "lora_A", "lora.down.weight", "_lora.down.weight",
                 "lora_linear_layer.down.weight"),
        "mid": ("lora_mid.weight",),
        "emb_down": ("lora_embedding_A", "lora_embedding_A.default", "lora_embedding_A.weight"),
        "emb_up": ("lora_embedding_B", "lora_embedding_B.default", "lora_embedding_B.weight"),
    }
    factor_roles = frozenset(roles)
    stage = "main"

    def build(self, found: Found) -> list[Patch]:  # noqa: D102
        out: list[Patch] = []
        if found.has("up", "down", "mid"):
            found.need("up", "down")
            down = found.get("down")
            # kohya's Flux trainer: stacked q/k/v (or linear1) factors whose alpha is one
            # split's (see LowRank.split_qkv)
            split = bool(
                found.fmt is not None and found.fmt.split_qkv_saves
                and found.key("up").endswith("lora_up.weight")
                and found.module.endswith(("qkv", "linear1")) and found.alpha is not None
            )
            out.append(LowRank("weight", up=found.get("up"), down=down, mid=found.get("mid"),
                               scale=found.scale(down.shape[0]), alpha_value=found.alpha,
                               transposed=found.transposed, split_qkv=split))
        if found.has("emb_up", "emb_down"):
            found.need("emb_up", "emb_down")
            down = found.get("emb_down")
            out.append(LowRank("weight", up=found.get("emb_up"), down=down,
                               scale=found.scale(down.shape[0]), alpha_value=found.alpha,
                               transposed=True))
        return out

    def spell(self, module: str, patch: LowRank, to: str,  # type: ignore[override]
              tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # noqa: D102
        if patch.transposed:
            raise UnsupportedFormatError(
                f"module {module!r}: transposed low-rank factors (embeddings, fan_in_fan_out) "
                f"have no {to} spelling; convert to peft instead."
            )
        if (not patch.split_qkv and module.endswith(("qkv", "linear1"))
                and len(split_blocks(tensors["up"].flatten(1), patch.rank)) > 1):
            raise UnsupportedFormatError(
                f"module {module!r}: a block-diagonal up on a qkv/linear1 layer reads back as a "
                f"kohya Flux split-qkv save, whose scale is multiplied by the number of blocks; "
                "convert to peft instead."
            )
        out = {f"{module}.lora_up.weight": tensors["up"],
               f"{module}.lora_down.weight": tensors["down"]}
        if patch.mid is not None:
            out[f"{module}.lora_mid.weight"] = tensors["mid"]
        return {**out, f"{module}.alpha": alpha_tensor(patch)}

    def lowrank(self, patch: Patch) -> LowRank | None:  # noqa: D102
        assert isinstance(patch, LowRank), f"a {patch.kind} patch under the lora kind"
        return patch
