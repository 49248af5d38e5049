"""``ModelOffloader``: a model kept in host memory, put on a device whole or block by block.

``from_module`` captures every parameter and buffer once (:class:`HostStorage`). Each
``activate`` (or ``use``) then places the model on a device for a while:

* without a :class:`StreamConfig`: every unit (the rest of the model and each block) is copied
  into its own device buffer, one copy per unit;
* with one: the rest of the model and the resident blocks are copied once; every other block
  streams through a fixed ring of slots (:class:`BlockStreamer`), ``prefetch`` blocks ahead.

Either can apply adapters for the activation (``loras=``): merged into each weight as its copy
lands (``lora_mode="merge"``) or added at forward time (``"dynamic"``); see
:mod:`shuttle.offload.adapters`. The host copy is never modified.

``deactivate`` points every tensor back at host storage and drops the device buffers. On the
CPU, activation is a pass-through (the host tensors are already where compute runs), unless the
test-only environment variable ``SHUTTLE_OFFLOAD_CPU_COPY=1`` is set: then CPU activation copies
through the same slots and hooks as CUDA does, so CI exercises the streaming logic.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from shuttle.apply.dynamic_layer import Quality
from shuttle.apply.plan import AdapterList, normalize_loras
from shuttle.errors import (
    AlreadyActiveError,
    BlockPathError,
    BudgetTooSmallError,
    OffloadError,
)
from shuttle.offload.adapters import ActivationAdapters, LoRAMode, check_lora_mode
from shuttle.offload.host_storage import HostBacking, HostStorage
from shuttle.offload.slots import SlotPool
from shuttle.offload.streamer import BlockStreamer
from shuttle.targets import KeyMapping

__all__ = ["CPU_COPY_ENV", "ModelOffloader", "ResidencyPlan", "StreamConfig"]

CPU_COPY_ENV = "SHUTTLE_OFFLOAD_CPU_COPY"


@dataclass(frozen=True)
class StreamConfig:
    """How blocks stream during one activation.

    Args:
        prefetch: blocks loaded ahead of the one computing; each group's ring has
            ``prefetch + 1`` slots (fewer when it has fewer streamed blocks).
        resident: blocks per group kept on the device for the whole activation (spread evenly
            over the group); default 0. Exclusive with ``vram_budget``.
        vram_budget: device bytes for weights (the rest of the model, resident blocks and ring
            slots; activations are not counted). As many blocks as fit are made resident;
            when even ``prefetch`` is too deep for the budget it is lowered.

    Raises:
        OffloadError: a negative or non-integer value, or both ``resident`` and
            ``vram_budget``.
    """

    prefetch: int = 2
    resident: int | None = None
    vram_budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("prefetch", "resident", "vram_budget"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise OffloadError(f"StreamConfig.{name}={v!r}: expected an integer >= 0")
        if self.resident is not None and self.vram_budget is not None:
            raise OffloadError("StreamConfig: give resident= or vram_budget=, not both "
                               "(the budget chooses the resident count)")


@dataclass(frozen=True)
class ResidencyPlan:
    """What one activation keeps on the device.

    Attributes:
        resident: per group, the positions of blocks kept on the device.
        ring: per group, the number of streaming slots (0: nothing streams).
        prefetch: the prefetch depth used (lowered from the config's to fit a budget).
        device_bytes: weight bytes on the device: the rest of the model plus every slot.
    """

    resident: dict[str, tuple[int, ...]] = field(default_factory=dict)
    ring: dict[str, int] = field(default_factory=dict)
    prefetch: int = 0
    device_bytes: int = 0


def _spread(count: int, n: int) -> tuple[int, ...]:
    # Evenly spaced positions: copies of streamed blocks overlap resident blocks' compute.
    return tuple(sorted({int((j + 0.5) * n / count) for j in range(count)}))


def plan_residency(storage: HostStorage, config: StreamConfig | None) -> ResidencyPlan:
    """Choose resident blocks and ring sizes for ``config`` (None: everything resident).

    Raises:
        BudgetTooSmallError: ``config.vram_budget`` cannot hold the rest of the model plus
            one slot per group.
    """
    rest = storage.rest.layout.nbytes
    sizes = {g: (len(us), us[0].layout.nbytes) for g, us in storage.groups.items()}

    def cost(res: dict[str, int], p: int) -> int:
        return rest + sum((res[g] + min(p + 1, n - res[g])) * b for g, (n, b) in sizes.items())

    def plan(res: dict[str, int], p: int) -> ResidencyPlan:
        return ResidencyPlan({g: _spread(res[g], n) if res[g] else () for g, (n, _) in
                              sizes.items()},
                             {g: min(p + 1, n - res[g]) for g, (n, _) in sizes.items()},
                             p, cost(res, p))

    if config is None:
        return plan({g: n for g, (n, _) in sizes.items()}, 0)
    if config.vram_budget is None:
        return plan({g: min(config.resident or 0, n) for g, (n, _) in sizes.items()},
                    config.prefetch)
    budget, res = config.vram_budget, {g: 0 for g in sizes}
    if cost(res, 0) > budget:
        raise BudgetTooSmallError(
            f"vram_budget={budget} bytes cannot hold the non-block weights ({rest} bytes) plus "
            f"one slot per block group ({cost(res, 0) - rest} bytes): give at least "
            f"{cost(res, 0)} bytes, or list more of the model under block paths"
        )
    p = next(q for q in range(config.prefetch, -1, -1) if cost(res, q) <= budget)
    grown = True
    while grown:  # one more resident block per group per round, while the budget allows
        grown = False
        for g, (n, _) in sizes.items():
            if res[g] < n:
                res[g] += 1
                if cost(res, p) <= budget:
                    grown = True
                else:
                    res[g] -= 1
    return plan(res, p)


class _Activation:
    """What one activation put on the device, so that teardown can undo it."""

    def __init__(self, device: torch.device, plan: ResidencyPlan | None,
                 adapters: ActivationAdapters | None = None):
        self.device = device
        self.plan = plan
        self.adapters = adapters
        self.pools: list[SlotPool] = []
        self.streamers: dict[str, BlockStreamer] = {}


class ModelOffloader:
    """A model in host memory, activated on a device whole or with streamed blocks.

    Build with :meth:`from_module`. Uses are sequential: one activation at a time.

    Attributes:
        model: the wrapped model (the same object, its tensors now in host storage).
        storage: the host storage (``host_bytes``, ``pinned_bytes``, ``weight_bytes``).
        blocks: block path -> the blocks streamed from it.
    """

    def __init__(self, model: torch.nn.Module, blocks: dict[str, list[torch.nn.Module]],
                 storage: HostStorage):
        self.model = model
        self.blocks = blocks
        self.storage = storage
        self._active: _Activation | None = None

    @classmethod
    def from_module(cls, model: torch.nn.Module, blocks: str | Sequence[str] = (),
                    host: HostBacking = "pinned") -> ModelOffloader:
        """Capture ``model``'s parameters and buffers into host storage.

        Args:
            model: the model; its parameters keep their identity (``.data`` is re-pointed).
            blocks: dotted paths of ``nn.ModuleList``/``nn.Sequential`` whose entries may
                stream; each path is its own group (its blocks must share one layout).
            host: ``"pinned"`` (page-locked copies, at most one arena per block; pageable
                originals freed as copied) or ``"adopt"`` (keep the CPU tensors, zero-copy).

        Raises:
            BlockPathError: a path names nothing, or not a non-empty block list, or two paths
                overlap.
            BlockLayoutError: blocks of one group differ, or a tensor is tied across units.
            HostBackingError: a tensor that cannot be kept as ``host`` asks.
            OffloadError: an unknown ``host``.
            Nothing is changed when any of these is raised.
        """
        if host not in ("pinned", "adopt"):
            raise OffloadError(f"host={host!r}: expected 'pinned' (copies) or 'adopt' "
                               "(keep the CPU tensors)")
        paths = [blocks] if isinstance(blocks, str) else list(blocks)
        groups = {p: _block_list(model, p) for p in paths}
        if len(groups) != len(paths):
            raise BlockPathError(f"blocks={paths}: a path is listed twice")
        _check_disjoint(groups)
        return cls(model, groups, HostStorage(model, groups, host))

    @property
    def active(self) -> bool:
        """Whether an activation is in progress."""
        return self._active is not None

    @property
    def device(self) -> torch.device | None:
        """The device of the current activation (None when inactive)."""
        return self._active.device if self._active else None

    @property
    def plan(self) -> ResidencyPlan | None:
        """The current activation's residency (None when inactive or a CPU pass-through)."""
        return self._active.plan if self._active else None

    @property
    def streamers(self) -> dict[str, BlockStreamer]:
        """The current activation's streamers, per group that streams."""
        return dict(self._active.streamers) if self._active else {}

    @property
    def adapters(self) -> ActivationAdapters | None:
        """The current activation's adapters (``report``, ``mode``); None without any."""
        return self._active.adapters if self._active else None

    def activate(self, device: str | torch.device = "cuda",
                 stream: StreamConfig | None = None, *, loras: AdapterList = (),
                 lora_mode: LoRAMode = "merge", quality: Quality | None = None,
                 mapping: KeyMapping | None = None) -> torch.nn.Module:
        """Place the model on ``device``, with adapters applied if given; returns the model.

        Args:
            device: where to compute. ``"cpu"`` is a pass-through.
            stream: stream blocks as configured; None puts the whole model on the device.
            loras: ``[(lora, strength), ...]`` applied for this activation only; strengths of
                exactly 0 are dropped before anything is built.
            lora_mode: ``"merge"``: folded into each weight right after its copy lands (float32
                sum, one rounding: the weights :func:`~shuttle.merge_lora` would give; a block
                streamed again is merged again from the pristine host copy). ``"dynamic"``:
                added at forward time by hooks (as :func:`~shuttle.attach_lora`), weights
                untouched. Either way the patch tensors are read onto ``device`` once.
            quality: the dynamic tier (``"exact"``, ``"lossless"``, ``"fused"``).
            mapping: adapter module key -> model module path, as for ``merge_lora``.

        Raises:
            AlreadyActiveError: an activation is in progress (call ``deactivate`` first).
            BudgetTooSmallError: ``stream.vram_budget`` is too small; nothing was changed.
            OffloadError: an unknown ``lora_mode`` or ``quality``.
            Everything :func:`~shuttle.merge_lora` raises for bad adapters (and
            ``UnsupportedLayerError`` for a patch a layer cannot take dynamically), before any
            device memory is taken for weights; the offloader stays inactive.
            Any failure while placing the model is re-raised after a full rollback (hooks
            removed, device buffers dropped, tensors back on the host); the offloader stays
            usable.
        """
        if self._active is not None:
            raise AlreadyActiveError(
                f"the offloader is already active on {self._active.device}; call deactivate() "
                "(or leave the use() block) before activating again"
            )
        check_lora_mode(lora_mode, quality)
        pairs = normalize_loras(loras)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        through = device.type == "cpu" and os.environ.get(CPU_COPY_ENV) != "1"
        plan = None if through else plan_residency(self.storage, stream)
        adapters = ActivationAdapters(self.model, self.storage, pairs, lora_mode, device,
                                      quality, mapping) if pairs else None
        active = _Activation(device, plan, adapters)
        try:
            if through:
                self._pass_through(active)
            else:
                self._place(active, stream)
            if adapters is not None and adapters.mode == "dynamic":
                adapters.attach()  # after the stream hooks: they bind weights first
        except BaseException:
            self._teardown(active)
            raise
        self._active = active
        return self.model

    def deactivate(self) -> None:
        """End the activation: hooks removed, tensors back on the host, device slots dropped.

        The device memory returns to PyTorch's caching allocator (no ``empty_cache``). Does
        nothing when inactive.
        """
        if self._active is not None:
            active, self._active = self._active, None
            self._teardown(active)

    @contextlib.contextmanager
    def use(self, device: str | torch.device = "cuda", stream: StreamConfig | None = None, *,
            loras: AdapterList = (), lora_mode: LoRAMode = "merge",
            quality: Quality | None = None, mapping: KeyMapping | None = None
            ) -> Iterator[torch.nn.Module]:
        """``activate`` for the ``with`` block, ``deactivate`` after it (also on error)."""
        model = self.activate(device, stream, loras=loras, lora_mode=lora_mode,
                              quality=quality, mapping=mapping)
        try:
            yield model
        finally:
            self.deactivate()

    def _pass_through(self, active: _Activation) -> None:
        # The host tensors are where compute runs: adapted tensors get merged copies instead.
        adapters = active.adapters
        if adapters is not None and adapters.mode == "merge":
            for unit in self.storage.units:
                if adapters.touches(unit):
                    unit.bind(adapters.merged_copies(unit))

    def _place(self, active: _Activation, stream: StreamConfig | None) -> None:
        plan, device = active.plan, active.device
        assert plan is not None
        copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        fold = active.adapters.fold if active.adapters and active.adapters.mode == "merge" \
            else None
        rest = self.storage.rest
        if rest.layout.offsets:
            pool = SlotPool(rest.layout, 1, device, copy_stream, fold)
            active.pools.append(pool)
            pool.load(0, rest)
            pool.wait_loaded(0)
            rest.bind(pool.views[0])
        for g, units in self.storage.groups.items():
            resident = plan.resident[g]
            pool = SlotPool(units[0].layout, len(resident) + plan.ring[g], device, copy_stream,
                            fold)
            active.pools.append(pool)
            for slot, pos in enumerate(resident):
                pool.load(slot, units[pos])
                pool.wait_loaded(slot)
                units[pos].bind(pool.views[slot])
            if plan.ring[g]:
                streamer = BlockStreamer(self.blocks[g], units, pool, resident, plan.prefetch)
                active.streamers[g] = streamer
                streamer.attach()
                streamer.warm()

    def _teardown(self, active: _Activation) -> None:
        if active.adapters is not None:
            active.adapters.detach()
        for streamer in active.streamers.values():
            streamer.detach()
        for unit in self.storage.units:
            unit.bind_host()
        for pool in active.pools:
            pool.close()
        active.pools.clear()
        active.streamers.clear()


def _block_list(model: torch.nn.Module, path: str) -> list[torch.nn.Module]:
    lists = [n for n, m in model.named_modules()
             if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m)]
    try:
        container = model.get_submodule(path)
    except AttributeError:
        raise BlockPathError(f"blocks path {path!r} names no submodule of "
                             f"{type(model).__name__}; block lists in this model: "
                             f"{lists[:8]}") from None
    if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)) or not len(container):
        raise BlockPathError(f"blocks path {path!r} is a {type(container).__name__}, not a "
                             f"non-empty nn.ModuleList/nn.Sequential; block lists in this model: "
                             f"{lists[:8]}")
    return list(container)


def _check_disjoint(groups: dict[str, list[torch.nn.Module]]) -> None:
    owner: dict[int, str] = {}
    for path, blocks in groups.items():
        for i, block in enumerate(blocks):
            for m in block.modules():
                other = owner.setdefault(id(m), f"{path}.{i}")
                if other != f"{path}.{i}":
                    raise BlockPathError(f"block {path}.{i} overlaps {other} (a module in both); "
                                         "list block paths that do not nest or share modules")
