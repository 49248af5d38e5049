"""Merges into DTensor parameters: each rank updates its own shard, with no collective.

A merge plan is made against the global shapes (``DTensor.shape``), as for any model. Before
any write, :func:`localize` turns it into a plan over the local tensors: for a parameter whose
local tensor holds rows ``[R0, R1)`` and columns ``[C0, C1)`` of the global weight
(:func:`~shuttle.weights.dtensor.shard_window`), each contribution keeps the rows of its update
that fall in the window (``select_rows``: a low-rank ``up`` cut to those rows) and the columns
(``select_columns``: ``down`` cut to those columns). The local merge then computes exactly the
window of the global update: ``W_local + s * up[R0:R1] @ down[:, C0:C1]``, so every rank's
shard equals the same window of a single-process merge (bit for bit where the kernels compute
the same sums). Replicated parameters merge whole on every rank. Rows and columns are the only
sharded dimensions taken; ``Partial`` and strided placements, and sharded widenings, are
refused.

Stochastic rounding (the default into float8, or ``rounding="stochastic"``) into a DTensor's
plain local tensor draws by global element index (:class:`~shuttle.kernels.rounding.GlobalDraws`)
with the seed of the global contributions, so each shard gets the bits of the same window of
an unsharded stochastic merge with those draws, on any world size and mesh. A quantized or
scaled local tensor (NF4, scaled float8) encodes by blocks and scales that a shard boundary
cuts: sharded, it merges with ``rounding="nearest"`` (or replicated); asked otherwise, the
merge is refused.

:func:`agreed` runs the validation of a distributed call and has every rank learn whether any
rank failed (one all-reduce of a flag over the default process group) before the first write,
so that no rank is left with a half-patched shard because another failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

from shuttle.apply.plan import Contribution, MergePlan
from shuttle.apply.rounding import merge_seeds, rounding_for
from shuttle.errors import RankFailedError, UnsupportedPlacementError
from shuttle.kernels.rounding import GlobalDraws
from shuttle.patches.select_columns import select_columns
from shuttle.patches.select_rows import select_rows
from shuttle.weights.dtensor import is_dtensor, shard_window
from shuttle.weights.plain import is_plain_tensor

__all__ = ["agreed", "has_dtensors", "localize"]

T = TypeVar("T")


def has_dtensors(params: Mapping[str, torch.Tensor]) -> bool:
    """Whether any of ``params`` is a DTensor."""
    return any(is_dtensor(p) for p in params.values())


def localize(plan: MergePlan, params: Mapping[str, torch.Tensor], *,
             rounding: str | None = None, seed: int | None = None
             ) -> tuple[MergePlan, dict[str, torch.Tensor]]:
    """``plan`` and ``params`` with every DTensor parameter replaced by its local tensor and
    its contributions by their windows (see the module docs); others unchanged. DTensors
    rounded stochastically get :attr:`MergePlan.draws` (seeded by ``seed`` and the global
    contributions).

    Raises:
        UnsupportedPlacementError: a placement or a layout without a window, a shard of any
            dimension but rows and columns, a sharded parameter the plan widens, or
            stochastic rounding into a sharded non-plain weight. Nothing was changed.
    """
    local = dict(params)
    if not has_dtensors(params):
        return plan, local
    out: dict[str, list[Contribution]] = {}
    drawn: dict[str, tuple[int, ...]] = {}
    for name, contribs in plan.params.items():
        p = params[name]
        if not is_dtensor(p):
            out[name] = contribs
            continue
        window = shard_window(p, name)
        shape = tuple(p.shape)
        tensor = p.to_local()
        sharded = [d for d in range(len(shape)) if not window.covers(d, shape[d])]
        if name in plan.widen:
            raise UnsupportedPlacementError(
                f"parameter {name!r} is a DTensor the adapter widens (a control LoRA's "
                "img_in): widen and merge before sharding")
        if any(d > 1 for d in sharded):
            raise UnsupportedPlacementError(
                f"parameter {name!r} is sharded along dimension(s) {[d for d in sharded if d > 1]} "
                f"(placements {tuple(p.placements)}): adapters land on row (Shard(0)) and column "
                "(Shard(1)) shards only")
        if sharded and not is_plain_tensor(tensor) and rounding not in ("nearest",):
            raise UnsupportedPlacementError(
                f"parameter {name!r} is a sharded {tensor.dtype} weight: stochastic rounding "
                "would depend on the world size; pass rounding='nearest', or replicate it")
        local[name] = tensor
        out[name] = [c for c in (_window(c, window, shape) for c in contribs) if c is not None]
        if (is_plain_tensor(tensor) and tensor.dtype not in (torch.float32, torch.float64)
                and rounding_for(rounding, tensor.dtype) == "stochastic"):  # type: ignore[arg-type]
            drawn[name] = window.starts
    seeds = merge_seeds([(n, plan.params[n]) for n in drawn], seed)  # the global contributions
    draws = {n: GlobalDraws(s, starts, tuple(params[n].shape))
             for (n, starts), s in zip(drawn.items(), seeds, strict=True)}
    return dataclasses.replace(plan, params={n: cs for n, cs in out.items() if cs},
                               draws=draws), local


def _window(c: Contribution, window, shape: tuple[int, ...]) -> Contribution | None:
    """``c`` cut to the window, in local coordinates; None when it updates nothing there."""
    r0, r1 = window.starts[0], window.stops[0]
    a, b = c.rows or (0, shape[0])
    lo, hi = max(a, r0), min(b, r1)
    if lo >= hi:
        return None
    patch = c.patch
    if (lo, hi) != (a, b):
        patch = select_rows(patch, lo - a, hi - a)
    rows = None if (lo - r0, hi - r0) == (0, r1 - r0) else (lo - r0, hi - r0)
    if len(shape) > 1 and not window.covers(1, shape[1]):
        patch = select_columns(patch, window.starts[1], window.stops[1], shape[1])
    return dataclasses.replace(c, patch=patch, rows=rows)


def agreed(params: Mapping[str, torch.Tensor], validate: Callable[[], T]) -> T:
    """``validate()``, with every rank learning whether any rank's validation failed before
    any of them goes on to write (only where ``params`` holds DTensors and a process group is
    initialized; otherwise just ``validate()``).

    Raises:
        RankFailedError: another rank failed (this one passed); its own error is raised there.
        Whatever ``validate`` raised on this rank.
    """
    import torch.distributed as dist

    if not (has_dtensors(params) and dist.is_available() and dist.is_initialized()):
        return validate()
    error: BaseException | None = None
    result = None
    try:
        result = validate()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the agreement
        error = e
    device = next(p.device_mesh.device_type for p in params.values() if is_dtensor(p))
    flag = torch.tensor([1.0 if error is not None else 0.0],
                        device="cpu" if device == "cpu" else torch.device(device,
                                                                          torch.cuda.current_device()))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if flag.item() > 0:
        raise RankFailedError(
            f"rank {dist.get_rank()}: another rank's validation failed (its error names the "
            "cause); no rank changed a weight")
    return result  # type: ignore[return-value]
