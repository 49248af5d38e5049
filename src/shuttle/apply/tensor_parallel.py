"""The dynamic update on a tensor-parallel (DTensor-sharded) Linear, in DTensor ops.

FSDP2 swaps plain, gathered weights in for its forwards, which take the plain tiers; a layer
whose weight stays a DTensor through the forward (``ColwiseParallel``, ``RowwiseParallel``)
gets its update here, from the hook's concatenated factors, without a collective of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shuttle.apply.layer_kind import chain_dtype
from shuttle.weights.dtensor import shard_window

__all__ = ["TensorParallelUpdate"]


class TensorParallelUpdate:
    """One layer's update in DTensor ops, its DTensor factors kept between calls.

    The factors become DTensors laid out like the weight, from local slices of the hook's
    factors (no communication): a row-sharded weight (``ColwiseParallel``) takes ``B``'s rows
    and a replicated ``A``, so the update comes out sharded like the output; a column-sharded
    one (``RowwiseParallel``) takes ``A``'s columns and a replicated ``B``, so ``x A^T`` is a
    partial sum per rank and so is the update, which the layer's own all-reduce of its partial
    output sums once with it (no collective of its own; the bias stays the layer's, added once).

    Args:
        name: the layer's name in the model (for messages).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._factors: tuple | None = None  # (what they were built for, A, B, mesh)

    def __call__(self, module: torch.nn.Module, x: torch.Tensor, out: torch.Tensor,
                 down: torch.Tensor, up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``out + ((x @ down.T) * scale) @ up.T`` for the DTensors ``x`` and ``out`` the
        layer's parallel style gives its forward; ``down`` (R, K), ``up`` (N, R) and the
        float32 per-rank ``scale`` (R,) are the hook's plain, whole tensors.
        """
        from torch.distributed.tensor import DTensor, Replicate, Shard

        w = module.weight
        key = (id(w), tuple(w.placements), down.data_ptr(), up.data_ptr())
        if self._factors is None or self._factors[0] != key:
            window = shard_window(w, self.name)
            r0, r1 = window.starts[0], window.stops[0]
            c0, c1 = window.starts[1], window.stops[1]
            mesh = w.device_mesh
            a_place = [Shard(1) if p == Shard(1) else Replicate() for p in w.placements]
            b_place = [Shard(0) if p == Shard(0) else Replicate() for p in w.placements]
            a = DTensor.from_local(down[:, c0:c1], mesh, a_place, run_check=False,
                                   shape=down.shape, stride=down.stride())
            b = DTensor.from_local(up[r0:r1], mesh, b_place, run_check=False,
                                   shape=up.shape, stride=up.stride())
            self._factors = (key, a, b, mesh)
        _, a, b, mesh = self._factors
        scale = DTensor.from_local(scale, mesh, [Replicate()] * mesh.ndim, run_check=False)
        if x.dtype != a.dtype:  # x is never narrowed to the stored factors' dtype
            cd = chain_dtype(x.dtype, a.dtype)
            if cd != a.dtype:
                a, b = a.to(cd), b.to(cd)
            x = x.to(cd)
        h = F.linear(x, a)
        h = (h * scale).to(b.dtype)  # a 16-bit h times the float32 scale: computed in float32
        return out + F.linear(h, b).to(out.dtype)
