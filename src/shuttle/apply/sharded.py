"""Merges into DTensor parameters: each rank updates its own shard, with no collective.

A merge plan is made against the global shapes (``DTensor.shape``), as for any model. Before
any write, :func:`localize` turns it into a plan over the local tensors: for a parameter whose
local tensor holds rows ``[R0, R1)`` and columns ``[C0, C1)`` of the global weight, its
:class:`~shuttle.weights.dtensor.ShardedWeight` (the one place that knows a sharded
parameter) refuses what it cannot take and cuts each contribution to the rows of its update
that fall in the window (``select_rows``: a low-rank ``up`` cut to those rows) and the
columns (``select_columns``: ``down`` cut to those columns). The local merge then computes
exactly the window of the global update: ``W_local + s * up[R0:R1] @ down[:, C0:C1]``, so
every rank's shard equals the same window of a single-process merge (bit for bit where the
kernels compute the same sums). Replicated parameters merge whole on every rank. Rows and
columns are the only sharded dimensions taken; ``Partial`` and strided placements, and
sharded widenings, are refused.

Stochastic rounding (the default into float8, or ``rounding="stochastic"``) into a DTensor's
plain local tensor draws by global element index (:class:`~shuttle.kernels.rounding.GlobalDraws`)
with the seed of the global contributions, so each shard gets the bits of the same window of
an unsharded stochastic merge with those draws, on any world size and mesh. A quantized or
scaled local tensor (NF4, scaled float8) encodes by blocks and scales that a shard boundary
cuts: sharded, it merges with ``rounding="nearest"`` (or replicated); asked otherwise, the
merge is refused.

:func:`agreed` runs the validation of a distributed call and has every rank learn, before the
first write, whether any rank failed and whether all ranks are about to do the same work: one
all-gather over the default process group of each rank's failure flag and its fingerprint of
the work (:func:`merge_fingerprint`: a digest of the global plan -- every contribution's
parameter, strength, rows, patch kind and fields and its tensors' bytes -- with the rounding
and seed). A failed rank raises its own error, the others :class:`RankFailedError`; ranks
that agree on nothing failing but hold different fingerprints (another adapter, strength,
rounding, seed or key mapping on some rank, which would leave shards of different merges) all
raise :class:`RankMismatchError`. Either way no rank is left with a half-patched shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import torch

from shuttle.apply.plan import Contribution, MergePlan
from shuttle.apply.rounding import merge_seeds, rounding_for
from shuttle.errors import RankFailedError, RankMismatchError
from shuttle.kernels.rounding import GlobalDraws
from shuttle.patches import Patch, TensorRef, materialize
from shuttle.weights.dtensor import ShardedWeight, is_dtensor, sharded
from shuttle.weights.plain import is_plain_tensor

__all__ = ["agreed", "has_dtensors", "localize", "merge_fingerprint", "outcome_agreement"]

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
        shard = sharded(params[name], name)
        if shard is None:
            out[name] = contribs
            continue
        shard.check_merge(rounding, widened=name in plan.widen)
        local[name] = tensor = shard.local
        out[name] = [c for c in (_window(c, shard) for c in contribs) if c is not None]
        if (is_plain_tensor(tensor) and tensor.dtype not in (torch.float32, torch.float64)
                and rounding_for(rounding, tensor.dtype) == "stochastic"):  # type: ignore[arg-type]
            drawn[name] = shard.window.starts
    seeds = merge_seeds([(n, plan.params[n]) for n in drawn], seed)  # the global contributions
    draws = {n: GlobalDraws(s, starts, tuple(params[n].shape))
             for (n, starts), s in zip(drawn.items(), seeds, strict=True)}
    return dataclasses.replace(plan, params={n: cs for n, cs in out.items() if cs},
                               draws=draws), local


def _window(c: Contribution, shard: ShardedWeight) -> Contribution | None:
    """``c`` cut to the shard's window, in local coordinates; None when it updates nothing
    there.
    """
    cut = shard.cut(c.patch, c.rows)
    return None if cut is None else dataclasses.replace(c, patch=cut[0], rows=cut[1])


def outcome_agreement(model: torch.nn.Module) -> Callable[[BaseException | None], None] | None:
    """For a merge into ``model``'s DTensor parameters under a process group: a function every
    rank calls once with its outcome of a phase of writes (the exception it raised, or None).
    It returns only when no rank failed; otherwise it raises that exception on its own rank
    and :class:`RankFailedError` on the others, so each rank undoes its writes. None elsewhere
    (nothing to agree on).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    params = dict(model.named_parameters())
    if not has_dtensors(params):
        return None

    def agree(error: BaseException | None) -> None:
        def outcome() -> None:
            if error is not None:
                raise error

        agreed(params, outcome)

    return agree


def agreed(params: Mapping[str, torch.Tensor], validate: Callable[[], T],
           fingerprint: Callable[[T], bytes] | None = None) -> T:
    """``validate()``, with every rank learning, before any of them goes on to write, whether
    any rank's validation failed and whether every rank's ``fingerprint`` of its result is the
    same (only where ``params`` holds DTensors and a process group is initialized; otherwise
    just ``validate()``, and no fingerprint is taken).

    Args:
        params: the model's parameters (their DTensors name the device of the collective).
        validate: everything the call checks before its first write.
        fingerprint: a digest of the work ``validate``'s result describes
            (:func:`merge_fingerprint` of its plan); None: the ranks' work is not compared.

    Raises:
        RankFailedError: another rank failed (this one passed); its own error is raised there.
        RankMismatchError: no rank failed, but the ranks' fingerprints differ (raised on
            every rank).
        Whatever ``validate`` (or ``fingerprint``) raised on this rank.
    """
    import torch.distributed as dist

    if not (has_dtensors(params) and dist.is_available() and dist.is_initialized()):
        return validate()
    error: BaseException | None = None
    result = None
    digest = bytes(_DIGEST_BYTES)
    try:
        result = validate()
        if fingerprint is not None:
            digest = fingerprint(result)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the agreement
        error = e
    device = next(s.device_type for s in map(sharded, params.values()) if s is not None)
    device = torch.device("cpu") if device == "cpu" else torch.device(
        device, torch.cuda.current_device())
    # one row a rank: [failed, the digest as signed 64-bit words]
    words = [int.from_bytes(digest[i:i + 8], "little", signed=True)
             for i in range(0, _DIGEST_BYTES, 8)]
    mine = torch.tensor([int(error is not None), *words], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    table = [tuple(row) for row in torch.stack(rows).cpu().tolist()]
    if error is not None:
        raise error
    rank = dist.get_rank()
    failed = [r for r, row in enumerate(table) if row[0]]
    if failed:
        raise RankFailedError(
            f"rank {rank}: the validation of rank(s) {failed} failed (their error names the "
            "cause); no rank changed a weight")
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, row in enumerate(table):
        groups.setdefault(row[1:], []).append(r)
    if len(groups) > 1:
        raise RankMismatchError(
            f"rank {rank}: the ranks were asked for different merges (ranks "
            f"{' vs '.join(str(g) for g in groups.values())}: other adapters, strengths, "
            "rounding, seed or key mapping), which would leave shards of different merges; "
            "make the same call with the same adapters on every rank. No rank changed a weight")
    return result  # type: ignore[return-value]


# -- the fingerprint of a merge --------------------------------------------------------------

_DIGEST_BYTES = 16
_CHUNK_BYTES = 64 << 20  # device tensors are copied to the host for hashing in chunks this big
# id(tensor) -> (weak ref, version, digest): a tensor's bytes are hashed once while it is not
# modified in place (its version counter), so repeated merges of the same adapter do not
# hash it again; an entry leaves with its tensor (the weak ref's callback)
_DIGESTS: dict[int, tuple[weakref.ref, int, bytes]] = {}


def merge_fingerprint(plan: MergePlan, rounding: str | None = None,
                      seed: int | None = None) -> bytes:
    """A 16-byte digest of the merge ``plan`` describes, equal on two processes (up to a
    blake2b collision) only when they would write the same values.

    It covers, per planned parameter (by name), each contribution in order: its strength, its
    rows, its patch's kind and non-tensor fields (scale, alpha, layout, ...), and each of its
    tensors' shape, dtype and a blake2b digest of its bytes (two adapters with the same keys
    and shapes but other values differ); and the widened shapes, ``rounding`` and ``seed``.
    Key names and the key mapping count through where they land. A tensor's digest is kept
    while the tensor lives unmodified, so fingerprinting the same adapter again reads nothing;
    lazy tensors (a checkpoint load's plan) are read to hash them.

    Args:
        plan: a global (not localized) merge plan.
        rounding, seed: the merge's arguments.

    Returns:
        The digest.
    """
    h = hashlib.blake2b(repr((rounding, seed, sorted((n, tuple(s)) for n, s in
                                                    plan.widen.items()))).encode(),
                        digest_size=_DIGEST_BYTES)
    digests = _digests([t for cs in plan.params.values() for c in cs
                        for t in _patch_tensors(c.patch)])
    for name in sorted(plan.params):
        h.update(repr(name).encode())
        for c in plan.params[name]:
            h.update(repr((float(c.strength), c.rows)).encode())
            _hash_patch(h, c.patch, digests)
    return h.digest()


def _is_tensor(v: object) -> bool:
    return isinstance(v, torch.Tensor) or (not isinstance(v, Patch) and isinstance(v, TensorRef))


def _patch_tensors(patch: Patch) -> Iterator[object]:
    """Every tensor (or lazy tensor) of ``patch``'s fields, inner patches' included."""
    for f in dataclasses.fields(patch):
        v = getattr(patch, f.name)
        if isinstance(v, Patch):
            yield from _patch_tensors(v)
        elif _is_tensor(v):
            yield v


def _hash_patch(h, patch: Patch, digests: dict[int, bytes]) -> None:
    h.update(type(patch).__qualname__.encode())
    for f in dataclasses.fields(patch):
        v = getattr(patch, f.name)
        if isinstance(v, Patch):
            h.update(f.name.encode())
            _hash_patch(h, v, digests)
        elif _is_tensor(v):
            h.update(repr((f.name, tuple(v.shape), str(v.dtype))).encode())  # type: ignore[attr-defined]
            h.update(digests[id(v)])
        else:
            h.update(repr((f.name, v)).encode())


def _digests(tensors: list[object]) -> dict[int, bytes]:
    """Id -> blake2b digest of the bytes of each tensor (a lazy one read first), in logical
    (contiguous) order. A device's tensors go to the host in chunks of about
    ``_CHUNK_BYTES``, one transfer a chunk rather than one a tensor.
    """
    out: dict[int, bytes] = {}
    pending: dict[torch.device, list[tuple[object, torch.Tensor]]] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        known = _DIGESTS.get(id(t)) if isinstance(t, torch.Tensor) else None
        if known is not None and known[0]() is t and known[1] == _version(t):
            out[id(t)] = known[2]
            continue
        real = t if isinstance(t, torch.Tensor) else materialize(t)  # type: ignore[arg-type]
        flat = real.detach().contiguous().reshape(-1).view(torch.uint8)
        pending.setdefault(flat.device, []).append((t, flat))
    for device, group in pending.items():
        chunks: list[list[tuple[object, torch.Tensor]]] = [[]]
        size = 0
        for item in group:
            if size >= _CHUNK_BYTES or device.type == "cpu":
                chunks.append([])
                size = 0
            chunks[-1].append(item)
            size += item[1].numel()
        for chunk in filter(None, chunks):
            host = torch.cat([f for _, f in chunk]).cpu() if device.type != "cpu" else None
            offset = 0
            for t, flat in chunk:
                data = flat if host is None else host[offset:offset + flat.numel()]
                offset += flat.numel()
                digest = hashlib.blake2b(data.numpy(), digest_size=_DIGEST_BYTES).digest()
                out[id(t)] = digest
                _remember(t, digest)
    return out


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


def _remember(t: object, digest: bytes) -> None:
    """Keep ``t``'s digest while it lives unmodified (real tensors with a version only)."""
    if not isinstance(t, torch.Tensor) or (version := _version(t)) is None:
        return
    key = id(t)
    _DIGESTS[key] = (weakref.ref(t, lambda _, key=key: _DIGESTS.pop(key, None)), version,
                     digest)
