"""What one activation keeps on the device: :class:`StreamConfig` (asked) and
:class:`ResidencyPlan` (chosen by a :class:`ResidencyPolicy` from the host storage's unit
sizes; :func:`plan_residency` applies the config's policy and checks its plan).

A policy decides which blocks (and layers) stay on the device and how deep the rings are; the
streamer loads the others in model order through the rings. The default,
:class:`SpreadResidency`, keeps as many blocks as the budget allows, spread evenly so that
streamed blocks' copies overlap resident blocks' compute; :class:`RingOnlyResidency` keeps
none (the smallest footprint, used before a module's activations are known). Another policy
(by measured block time, by access frequency) is one class with a ``plan`` method, passed as
``StreamConfig(policy=...)``.

Costs count each unit's own size: the blocks of one group may differ (T5's first block holds
the relative attention bias), so a resident block takes its own bytes and a ring slot the bytes
of the group's largest *streamed* block. The budget is a ceiling on everything the forward
holds on the device: ``StreamConfig.activation_bytes`` of it are kept for activations, and the
weights are planned within the remainder. The floor of a model (no resident block, one slot per
group, plus the activations) is the smallest budget that runs; below it
:class:`~shuttle.errors.BudgetTooSmallError` names it in bytes.

With a host ceiling (``from_module(..., max_host_bytes=...)``) the plan has a host tier too
(:func:`plan_host`): which units keep host arenas and how large the staging ring is; the other
units are read from their files at every load. :func:`plan_residency` adds it to every plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from shuttle.byte_count import ByteCount, byte_count
from shuttle.errors import BudgetTooSmallError, OffloadError
from shuttle.offload.disk_reader import IO_ALIGN
from shuttle.offload.host_storage import HostStorage
from shuttle.offload.host_unit import HostUnit
from shuttle.offload.spill import MIN_STAGING, staging_floor

__all__ = ["ResidencyPlan", "ResidencyPolicy", "RingOnlyResidency", "SpreadResidency",
           "StreamConfig", "check_given_plan", "check_plan", "floor_bytes", "plan_cost",
           "plan_host", "plan_residency"]


@dataclass(frozen=True)
class StreamConfig:
    """How blocks stream during one activation.

    Args:
        prefetch: blocks loaded ahead of the one computing; each group's ring has
            ``prefetch + 1`` slots (fewer when it has fewer streamed blocks).
        resident: blocks per group kept on the device for the whole activation (spread evenly
            over the group); default 0. Exclusive with ``vram_budget``.
        vram_budget: device bytes for the activation: the weights (the rest of the model,
            resident blocks and ring slots) plus ``activation_bytes``. As many blocks as fit
            are made resident; when even ``prefetch`` is too deep for the budget it is lowered.
            Bytes, or as :func:`~shuttle.byte_count.byte_count` reads them (``6e9``,
            ``"6GiB"``); kept as an ``int``.
        compile: compile each block's forward with ``torch.compile`` (weight loading stays
            outside the graph; one compile per block class and shape): ``True`` for the
            default backend (inductor), or a backend (``"aot_eager"``, a callable).
            Needs block lists (``from_module(..., blocks=...)``).
        policy: the :class:`ResidencyPolicy` choosing what stays on the device (default:
            :class:`SpreadResidency`).
        activation_bytes: device bytes of ``vram_budget`` kept for what the forward allocates
            (activations, workspaces); the weights are planned within the remainder. Needs
            ``vram_budget``. The integrations measure it per module (see
            :mod:`shuttle.integrations.activations`).

    In layer mode ``prefetch`` counts layers, ``resident`` is the number of layers kept on
    the device (spread evenly), and ``vram_budget`` also pays for the layer ring
    (``prefetch + 1`` slots of the largest streamed layer) before any layer is made resident.

    Raises:
        OffloadError: a negative or non-integer count, a budget that is not a number of
            bytes, both ``resident`` and
            ``vram_budget``, ``activation_bytes`` without ``vram_budget``, a ``compile`` that
            is neither a bool, a string nor callable, or a ``policy`` without a ``plan``
            method.
    """

    prefetch: int = 2
    resident: int | None = None
    vram_budget: ByteCount | None = None
    compile: bool | str | Callable[..., Any] = False
    policy: ResidencyPolicy | None = None
    activation_bytes: int = 0

    def __post_init__(self) -> None:
        if self.policy is not None and not isinstance(self.policy, ResidencyPolicy):
            raise OffloadError(f"StreamConfig.policy={self.policy!r}: expected an object with "
                               "a plan(storage, config) method (a ResidencyPolicy)")
        if not isinstance(self.compile, (bool, str)) and not callable(self.compile):
            raise OffloadError(f"StreamConfig.compile={self.compile!r}: expected a bool, a "
                               "backend name or a backend callable")
        for name in ("vram_budget", "activation_bytes"):
            if getattr(self, name) is not None:  # frozen: set once, here, as an int
                object.__setattr__(self, name, byte_count(getattr(self, name),
                                                          f"StreamConfig.{name}", OffloadError))
        for name in ("prefetch", "resident"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise OffloadError(f"StreamConfig.{name}={v!r}: expected an integer >= 0")
        if self.resident is not None and self.vram_budget is not None:
            raise OffloadError("StreamConfig: give resident= or vram_budget=, not both "
                               "(the budget chooses the resident count)")
        if self.activation_bytes and self.vram_budget is None:
            raise OffloadError(f"StreamConfig(activation_bytes={self.activation_bytes}) keeps "
                               "part of vram_budget for activations: give vram_budget too")


@dataclass(frozen=True)
class ResidencyPlan:
    """What one activation keeps on the device.

    Attributes:
        resident: per group, the positions of blocks kept on the device.
        ring: per group, the number of streaming slots (0: nothing streams).
        prefetch: the prefetch depth used (lowered from the config's to fit a budget).
        device_bytes: weight bytes on the device: the rest of the model plus every slot
            (activations not included).
        layers: layer mode: positions (in ``storage.layers``) of the layers kept on the device.
        layer_ring: layer mode: the number of streaming slots for layers (0: none stream).
        pinned: the host tier (with a host ceiling): names of the units kept in host arenas;
            every other unit is read from its files at each load. None: no ceiling, every
            unit in host memory.
        staging: the host tier: ``(buffers, bytes each)`` of the staging ring that units on
            disk are read through (``(0, 0)``: none on disk).
        host_bytes: host bytes of the host tier: the arenas of ``pinned`` plus the staging
            ring (0 without a ceiling).
    """

    resident: dict[str, tuple[int, ...]] = field(default_factory=dict)
    ring: dict[str, int] = field(default_factory=dict)
    prefetch: int = 0
    device_bytes: int = 0
    layers: tuple[int, ...] = ()
    layer_ring: int = 0
    pinned: frozenset[str] | None = None
    staging: tuple[int, int] = (0, 0)
    host_bytes: int = 0


def _spread(count: int, n: int) -> tuple[int, ...]:
    # Evenly spaced positions: copies of streamed blocks overlap resident blocks' compute.
    return tuple(sorted({int((j + 0.5) * n / count) for j in range(count)}))


@runtime_checkable
class ResidencyPolicy(Protocol):
    """Chooses what one activation keeps on the device.

    ``plan`` returns a :class:`ResidencyPlan` for ``storage`` (its ``groups``: block group ->
    units in model order, ``layers``, and ``rest``, each with ``layout.nbytes``) under
    ``config`` (never None: a missing config keeps everything resident without asking).
    Its ``device_bytes`` is recomputed and checked against ``config.vram_budget`` by
    :func:`plan_residency`; :func:`plan_cost` gives the figure for a candidate.
    """

    def plan(self, storage: HostStorage, config: StreamConfig) -> ResidencyPlan: ...


def plan_cost(storage: HostStorage, resident: dict[str, tuple[int, ...]], ring: dict[str, int],
              layers: tuple[int, ...] = (), layer_ring: int = 0) -> int:
    """Device weight bytes of a plan: the rest of the model; per group, each resident block at
    its own size and ``ring`` slots the size of the group's largest streamed block; the
    resident layers and the layer ring (slots of the largest streamed layer); the staging
    buffer of coded units. A ring with nothing streamed costs nothing (no slot is allocated
    for it).
    """
    total = storage.rest.layout.nbytes + storage.stage_bytes
    for g, units in storage.groups.items():
        total += _units_cost([u.layout.nbytes for u in units], resident.get(g, ()),
                             ring.get(g, 0))
    return total + _units_cost([u.layout.nbytes for u in storage.layers], layers, layer_ring)


def _units_cost(sizes: list[int], kept: tuple[int, ...], ring: int) -> int:
    """Bytes of the ``kept`` units at their own sizes plus ``ring`` slots of the largest other."""
    keep = set(kept)
    streamed = [b for i, b in enumerate(sizes) if i not in keep]
    return sum(sizes[i] for i in keep) + ring * max(streamed, default=0)


def floor_bytes(storage: HostStorage) -> int:
    """The smallest weight footprint of ``storage`` on the device: the rest of the model, one
    slot of each group's largest block, one slot of the largest layer (prefetch 0, nothing
    resident). A module's floor budget is this plus its activations.
    """
    return plan_cost(storage, {}, {g: 1 for g in storage.groups}, (), 1)


def plan_residency(storage: HostStorage, config: StreamConfig | None) -> ResidencyPlan:
    """The plan of ``config``'s policy (None: everything resident), checked.

    Raises:
        BudgetTooSmallError: ``config.vram_budget`` is below the floor: the rest of the model
            plus one slot of each group's largest block (and of the largest layer, in layer
            mode) plus ``config.activation_bytes``.
        OffloadError: a custom policy's plan names blocks or layers the storage lacks, leaves
            a group or the layers with streamed units but no ring slot, or exceeds the budget
            (less ``config.activation_bytes``).
    """
    if config is None:
        everything = {g: tuple(range(len(us))) for g, us in storage.groups.items()}
        layers = tuple(range(len(storage.layers)))
        return plan_host(storage, ResidencyPlan(everything, {g: 0 for g in everything}, 0,
                                                plan_cost(storage, everything, {}, layers),
                                                layers, 0))
    policy = config.policy or SpreadResidency()
    plan = plan_host(storage, policy.plan(storage, config))
    if not isinstance(policy, SpreadResidency):
        check_plan(plan, storage, config.vram_budget, type(policy).__name__,
                   config.activation_bytes)
    return plan


def check_plan(plan: ResidencyPlan, storage: HostStorage, vram_budget: int | None = None,
               who: str = "activate(plan=...)", activation_bytes: int = 0) -> None:
    """Raise unless ``plan`` fits ``storage`` (and ``vram_budget`` less ``activation_bytes``,
    when a budget is given).

    Raises:
        OffloadError: the plan names blocks or layers the storage lacks, leaves a group or the
            layers with streamed units but no ring slot, misstates its device bytes, or
            exceeds the budget.
    """
    if set(plan.resident) != set(storage.groups) or set(plan.ring) != set(storage.groups):
        raise OffloadError(f"{who}: its plan covers groups {sorted(plan.resident)} / "
                           f"{sorted(plan.ring)}, the model has {sorted(storage.groups)}")
    for g, units in storage.groups.items():
        kept = plan.resident[g]
        if any(not 0 <= i < len(units) for i in kept) or len(set(kept)) != len(kept):
            raise OffloadError(f"{who}: resident positions {kept} of group {g!r}, which has "
                               f"{len(units)} blocks")
        if len(kept) < len(units) and plan.ring[g] < 1:
            raise OffloadError(f"{who}: group {g!r} streams blocks but has no ring slot")
    n = len(storage.layers)
    if any(not 0 <= i < n for i in plan.layers) or (len(plan.layers) < n and plan.layer_ring < 1):
        raise OffloadError(f"{who}: layer plan {plan.layers} (ring {plan.layer_ring}) does not "
                           f"fit the model's {n} layers")
    cost = plan_cost(storage, plan.resident, plan.ring, plan.layers, plan.layer_ring)
    if plan.device_bytes != cost:
        raise OffloadError(f"{who}: its plan says {plan.device_bytes} device bytes, its "
                           f"blocks and slots take {cost} (plan_cost)")
    if vram_budget is not None and cost > vram_budget - activation_bytes:
        less = f" less activation_bytes={activation_bytes}" if activation_bytes else ""
        raise OffloadError(f"{who}: its plan takes {cost} device bytes, over vram_budget="
                           f"{vram_budget}{less}")
    _check_host_tier(plan, storage, who)


def _check_host_tier(plan: ResidencyPlan, storage: HostStorage, who: str) -> None:
    """Raise unless ``plan``'s host tier fits ``storage`` and its ceiling."""
    ceiling = storage.max_host_bytes
    if ceiling is None:
        if plan.pinned is not None:
            raise OffloadError(f"{who}: its plan has a host tier, and the model has no host "
                               "ceiling (from_module(..., max_host_bytes=...))")
        return
    if plan.pinned is None:
        raise OffloadError(f"{who}: the model has a host ceiling (max_host_bytes={ceiling}) and "
                           "its plan no host tier: make the plan with the offloader's plan_for()")
    units = {u.name: u for u in storage.units}
    unknown = sorted(set(plan.pinned) - set(units))
    fixed = [u.name for u in storage.fixed if u.name not in plan.pinned]
    disk = [u for u in storage.units if u.spans is not None and u.name not in plan.pinned]
    if unknown or fixed or (disk and (plan.staging[0] < 1 or plan.staging[1] < IO_ALIGN)):
        raise OffloadError(f"{who}: its host tier keeps unknown units {unknown[:4]}, leaves out "
                           f"units that cannot be read from files {fixed[:4]}, or has no staging "
                           f"buffer for the {len(disk)} units on disk ({plan.staging})")
    largest = max((u.spans.nbytes for u in disk), default=0)  # type: ignore[union-attr]
    if storage.coded_on_disk and disk and plan.staging[1] < largest:
        raise OffloadError(f"{who}: its staging buffers of {plan.staging[1]} bytes would read "
                           f"units coded in their files in pieces; they need {largest} bytes")
    cost = _host_cost(storage, [units[n] for n in plan.pinned], plan.staging)
    if plan.host_bytes != cost or cost > ceiling:
        raise OffloadError(f"{who}: its host tier says {plan.host_bytes} bytes, its arenas and "
                           f"staging take {cost}, max_host_bytes={ceiling}")


def _host_cost(storage: HostStorage, pinned: list[HostUnit], staging: tuple[int, int]) -> int:
    """Host bytes of the arenas of ``pinned``, the staging ring and the side entries."""
    n, size = staging
    return (storage.side_bytes + sum(storage.arena_bytes(u) for u in pinned)
            + n * -(-size // IO_ALIGN) * IO_ALIGN)


def plan_host(storage: HostStorage, plan: ResidencyPlan) -> ResidencyPlan:
    """``plan`` with its host tier under ``storage.max_host_bytes`` (unchanged without one).

    The units that cannot be read from files keep their arenas. The staging ring comes next:
    ``prefetch + 1`` buffers as large as the largest unit left on disk (one read per load, one
    read ahead per prefetched unit); then arenas for the other units while the ceiling allows,
    hottest first: the units read on every pass (streamed blocks and layers, spread over each
    group so that reads from disk interleave with copies from memory), then those placed on the
    device once per activation (the rest, resident blocks and layers). When even the ring does
    not fit, it gets fewer buffers, then smaller ones (a unit is then read in chunks).

    Raises:
        BudgetTooSmallError: the ceiling cannot hold the units that must stay in host memory
            plus one staging buffer (the message names that floor in bytes).
    """
    ceiling = storage.max_host_bytes
    if ceiling is None:
        return plan
    everything = _host_cost(storage, storage.units, (0, 0))
    if everything <= ceiling:
        return dataclasses.replace(plan, pinned=frozenset(u.name for u in storage.units),
                                   staging=(0, 0), host_bytes=everything)
    held = used = _host_cost(storage, storage.fixed, (0, 0))  # with the side arena
    order = _hot_first(storage, plan)
    by_size = sorted(order, key=lambda u: -u.spans.nbytes)  # type: ignore[union-attr]
    want = plan.prefetch + 1
    pinned: set[int] = set()

    def largest(skip: HostUnit | None = None) -> int:  # of the units left on disk
        return next((u.spans.nbytes for u in by_size  # type: ignore[union-attr]
                     if id(u) not in pinned and u is not skip), 0)

    for u in order:
        if used + storage.arena_bytes(u) + want * _aligned(largest(u)) <= ceiling:
            pinned.add(id(u))
            used += storage.arena_bytes(u)
    whole = storage.coded_on_disk
    staging = _fit_staging(ceiling - used, largest(), want, whole)
    if staging is None:
        floor = held + staging_floor(largest(), whole)
        raise BudgetTooSmallError(
            f"max_host_bytes={ceiling} bytes cannot hold the units that must stay in host "
            f"memory plus one staging buffer: give at least {floor} bytes")
    keep = [u for u in storage.units if u.spans is None or id(u) in pinned]
    return dataclasses.replace(plan, pinned=frozenset(u.name for u in keep), staging=staging,
                               host_bytes=_host_cost(storage, keep, staging))


def _aligned(n: int) -> int:
    return -(-n // IO_ALIGN) * IO_ALIGN


def _fit_staging(room: int, largest: int, want: int, whole: bool = False
                 ) -> tuple[int, int] | None:
    """``(buffers, bytes)`` of the staging ring for units of at most ``largest`` read bytes in
    ``room`` bytes: ``want`` whole buffers if they fit, else fewer, else (unless ``whole``:
    coded units, read in one piece) two (then one) smaller ones of at least ``MIN_STAGING``
    bytes; None if not even that fits.
    """
    if not largest:
        return 0, 0
    size = _aligned(largest)
    for n in range(want, 0, -1):
        if n * size <= room:
            return n, size
    if whole:
        return None
    for n in (min(2, want), 1):
        part = room // n // IO_ALIGN * IO_ALIGN
        if part >= min(size, MIN_STAGING):
            return n, part
    return None


def _hot_first(storage: HostStorage, plan: ResidencyPlan) -> list[HostUnit]:
    """The units that may stay on disk, the most often read first (see :func:`plan_host`)."""
    streamed: list[tuple[float, int, HostUnit]] = []
    lists = [[u for i, u in enumerate(us) if plan.ring.get(g) and i not in plan.resident[g]]
             for g, us in storage.groups.items()]
    if plan.layer_ring:
        kept = set(plan.layers)
        lists.append([u for i, u in enumerate(storage.layers) if i not in kept])
    for k, units in enumerate(lists):
        streamed += [(rank / len(units), k, units[i])
                     for rank, i in enumerate(_spread_order(len(units)))]
    hot = [u for _, _, u in sorted(streamed, key=lambda t: t[:2])]
    seen = {id(u) for u in hot}
    return [u for u in hot + [u for u in storage.units if id(u) not in seen]
            if u.spans is not None]


def _spread_order(n: int) -> list[int]:
    """``range(n)`` in an order whose every prefix is spread evenly (van der Corput)."""
    out: list[int] = []
    seen: set[int] = set()
    i = 0
    while len(out) < n:
        x, scale, k = 0.0, 0.5, i
        while k:
            x, scale, k = x + scale * (k & 1), scale / 2, k >> 1
        p = int(x * n)
        if p not in seen:
            seen.add(p)
            out.append(p)
        i += 1
    return out


class SpreadResidency:
    """The default policy: with a budget, the deepest prefetch that fits (up to the config's),
    then one more resident block per group per round while the budget allows, then as many
    layers as fit; without one, ``config.resident`` blocks per group. Resident blocks are
    spread evenly over each group, so streamed blocks' copies overlap resident compute.
    """

    def plan(self, storage: HostStorage, config: StreamConfig) -> ResidencyPlan:  # noqa: D102
        return _spread_plan(storage, config, grow=True)


class RingOnlyResidency:
    """Every block and layer streams, none is resident: the smallest weight footprint at the
    deepest prefetch (up to the config's) that fits the budget, which leaves the most room for
    activations. ``config.resident`` is not read. The integrations' handles plan a module's
    first call this way, before its activations have been measured.
    """

    def plan(self, storage: HostStorage, config: StreamConfig) -> ResidencyPlan:  # noqa: D102
        return _spread_plan(storage, config, grow=False)


def _spread_plan(storage: HostStorage, config: StreamConfig, grow: bool) -> ResidencyPlan:
    rest = storage.rest.layout.nbytes + storage.stage_bytes  # (plan_cost's fixed part)
    sizes = {g: [u.layout.nbytes for u in us] for g, us in storage.groups.items()}
    layer_sizes = [u.layout.nbytes for u in storage.layers]
    n_layers = len(layer_sizes)

    def kept(count: int, n: int) -> tuple[int, ...]:
        return _spread(count, n) if count else ()

    def cost(res: dict[str, int], p: int, keep: tuple[int, ...] = ()) -> int:
        return (rest + _units_cost(layer_sizes, keep, min(p + 1, n_layers - len(keep)))
                + sum(_units_cost(b, kept(res[g], len(b)), min(p + 1, len(b) - res[g]))
                      for g, b in sizes.items()))

    def plan(res: dict[str, int], p: int, keep: tuple[int, ...]) -> ResidencyPlan:
        return ResidencyPlan({g: kept(res[g], len(b)) for g, b in sizes.items()},
                             {g: min(p + 1, len(b) - res[g]) for g, b in sizes.items()},
                             p, cost(res, p, keep), keep, min(p + 1, n_layers - len(keep)))

    none = {g: 0 for g in sizes}
    if config.vram_budget is None:
        if not grow:
            return plan(none, config.prefetch, ())
        r = min(config.resident or 0, n_layers)
        return plan({g: min(config.resident or 0, len(b)) for g, b in sizes.items()},
                    config.prefetch, _spread(r, n_layers) if r else ())
    budget, res = config.vram_budget - config.activation_bytes, dict(none)
    if cost(res, 0) > budget:
        raise BudgetTooSmallError(_below_floor(config, storage, rest, cost(res, 0), n_layers))
    p = next(q for q in range(config.prefetch, -1, -1) if cost(res, q) <= budget)
    if not grow:
        return plan(res, p, ())
    grown = True
    while grown:  # one more resident block per group per round, while the budget allows
        grown = False
        for g, b in sizes.items():
            if res[g] < len(b):
                res[g] += 1
                if cost(res, p) <= budget:
                    grown = True
                else:
                    res[g] -= 1
    # Then as many layers as fit, spread evenly (their copies overlap the resident ones).
    keep = next((k for r in range(n_layers, 0, -1) if cost(res, p, k := _spread(r, n_layers))
                 <= budget), ())
    return plan(res, p, keep)


def _below_floor(config: StreamConfig, storage: HostStorage, rest: int, weights: int,
                 n_layers: int) -> str:
    """The message of a budget below the floor: the floor in bytes and what it is made of."""
    floor = weights + config.activation_bytes
    what = " and of the largest layer" if n_layers else ""
    acts = (f" + {config.activation_bytes} bytes kept for activations (activation_bytes)"
            if config.activation_bytes else "")
    stage, unit = storage.stage_bytes, storage.stage_unit_bytes
    coded = (f" + {stage} bytes of staging for coded weights ({stage // unit} buffer(s) of the "
             "largest coded block)" if stage else "")
    fix = (f"; or decode on the copy stream with SHUTTLE_DECODE_STREAM=0 (one staging buffer: "
           f"a floor of {floor - (stage - unit)} bytes, a slower step)" if stage > unit else "")
    return (f"vram_budget={config.vram_budget} bytes is below this model's floor of {floor} "
            f"bytes: {rest - stage} bytes of non-block weights{coded} + {weights - rest} bytes "
            f"for one slot of each block group's largest block{what}{acts}; give at least "
            f"{floor} bytes, or list more of the model under block paths (smaller units lower "
            f"the floor){fix}")


def check_given_plan(plan: ResidencyPlan, stream: StreamConfig | None,
                      storage: HostStorage) -> None:
    """Refuse a plan given with a stream that asks for a residency of its own, or one made
    for another model (``activate(plan=...)``).

    Raises:
        OffloadError: either of those.
    """
    if stream is not None and (stream.vram_budget is not None or stream.resident is not None
                               or stream.policy is not None):
        raise OffloadError(
            "activate(plan=..., stream=StreamConfig(vram_budget/resident/policy=...)): the "
            "plan was chosen from a residency already; give the plan alone (with "
            "StreamConfig(compile=...) if needed), or the stream alone")
    check_plan(plan, storage)
