"""One activation of a :class:`~shuttle.offload.ModelOffloader`: what it put on the device
(pools, slots, streamers, the decoder of coded units) and how it is placed and taken down.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from shuttle.offload.adapters import ActivationAdapters
from shuttle.offload.coded import Decoder
from shuttle.offload.compiled import BlockCompiler
from shuttle.offload.host_storage import HostStorage, Layout
from shuttle.offload.host_unit import HostUnit
from shuttle.offload.layer_streamer import LayerStreamer
from shuttle.offload.residency import ResidencyPlan
from shuttle.offload.slots import SlotPool
from shuttle.offload.streamer import BlockStreamer

__all__ = ["CPU_COPY_ENV", "Activation", "copy_stream_of", "move"]

CPU_COPY_ENV = "SHUTTLE_OFFLOAD_CPU_COPY"


class Activation:
    """What one activation put on the device, so that teardown can undo it."""

    def __init__(self, device: torch.device, plan: ResidencyPlan | None,
                 adapters: ActivationAdapters | None = None):
        self.device = device
        self.plan = plan
        self.adapters = adapters
        self.pools: list[SlotPool] = []
        self.streamers: dict[str, BlockStreamer] = {}
        self.layer_streamer: LayerStreamer | None = None
        self.compiler: BlockCompiler | None = None
        # (pool, slot, unit) of every unit on the device for the whole activation.
        self.placed: list[tuple[SlotPool, int, HostUnit]] = []
        self.decoder: Decoder | None = None  # coded units' staging (compress="lossless")
        # (pool, slot) of placed units the compute stream has not been made to wait for yet
        # (``place(wait=False)``: :meth:`ready` makes it wait); None: each waited for at once.
        self.unready: list[tuple[SlotPool, int]] | None = None

    def pass_through(self, storage: HostStorage) -> None:
        """Run on the host tensors themselves (the CPU pass-through)."""
        # The host tensors are where compute runs: adapted tensors get merged copies instead,
        # and coded units decoded copies (for the activation; bind_host drops them).
        adapters = self.adapters
        for unit in storage.units:
            if adapters is not None and adapters.merges and adapters.touches(unit):
                unit.bind(adapters.merged_copies(unit))
            elif unit.code is not None:
                unit.bind(unit.host_tensors())

    def place(self, storage: HostStorage, blocks: dict[str, list[torch.nn.Module]],
              layers: dict[str, torch.nn.Module], wait: bool = True) -> None:
        """Load the plan's resident units, build the rings and attach the streamers.

        ``wait=False`` leaves the current stream free of the resident units' copies: work
        queued on it next (another module's call) runs beside them, and :meth:`ready` must be
        called before the model's own forward.
        """
        plan, device = self.plan, self.device
        self.unready = None if wait else []
        assert plan is not None
        copy_stream = copy_stream_of(device) if device.type == "cuda" else None
        fold = self.adapters.fold if self.adapters and self.adapters.merges else None
        if storage.stage_unit_bytes:
            self.decoder = Decoder(device, storage.stage_unit_bytes, copy_stream)
        rest = storage.rest
        if rest.layout.offsets:
            self._place_resident([rest], copy_stream, fold)
        for g, units in storage.groups.items():
            resident = plan.resident[g]
            self._place_resident([units[pos] for pos in resident], copy_stream, fold)
            kept = set(resident)
            streamed = [u.layout for i, u in enumerate(units) if i not in kept]
            if plan.ring[g] and streamed:
                # One ring per group; blocks that differ share slots sized by the largest.
                pool = (SlotPool(streamed[0], plan.ring[g], device, copy_stream, fold,
                                 self.decoder)
                        if all(lay == streamed[0] for lay in streamed) else
                        SlotPool.for_layouts(streamed, plan.ring[g], device, copy_stream, fold,
                                             self.decoder))
                self.pools.append(pool)
                streamer = BlockStreamer(blocks[g], units, pool, resident, plan.prefetch)
                self.streamers[g] = streamer
                streamer.attach()
                streamer.warm()
        if storage.layers:
            self._place_layers(storage, layers, copy_stream, fold)

    def _place_resident(self, units: list[HostUnit],
                        copy_stream: torch.cuda.Stream | None,
                        fold: Callable[..., None] | None) -> None:
        """Load ``units`` for the whole activation, each into a slot of exactly its layout
        (one pool per distinct layout), and bind them there.
        """
        by_layout: dict[Layout, list[HostUnit]] = {}
        for unit in units:
            by_layout.setdefault(unit.layout, []).append(unit)
        for layout, same in by_layout.items():
            pool = SlotPool(layout, len(same), self.device, copy_stream, fold,
                            self.decoder)
            self.pools.append(pool)
            for slot, unit in enumerate(same):
                pool.load(slot, unit)
                self._loaded(pool, slot)
                unit.bind(pool.views[slot])
                self.placed.append((pool, slot, unit))

    def _place_layers(self, storage: HostStorage, layers: dict[str, torch.nn.Module],
                      copy_stream: torch.cuda.Stream | None,
                      fold: Callable[..., None] | None) -> None:
        plan, device, units = self.plan, self.device, storage.layers
        assert plan is not None
        for pos in plan.layers:  # one buffer each, loaded once
            pool = SlotPool(units[pos].layout, 1, device, copy_stream, fold, self.decoder)
            self.pools.append(pool)
            pool.load(0, units[pos])
            self._loaded(pool, 0)
            units[pos].bind(pool.views[0])
            self.placed.append((pool, 0, units[pos]))
        if plan.layer_ring:
            kept = set(plan.layers)
            pool = SlotPool.for_layouts([u.layout for i, u in enumerate(units) if i not in kept],
                                        plan.layer_ring, device, copy_stream, fold,
                                        self.decoder)
            self.pools.append(pool)
            streamer = LayerStreamer(list(layers.values()), units, pool, plan.layers,
                                     plan.prefetch)
            self.layer_streamer = streamer
            streamer.attach()
            streamer.warm()

    def _loaded(self, pool: SlotPool, slot: int) -> None:
        """The current stream waits for ``slot``'s load now, or at :meth:`ready`."""
        if self.unready is None:
            pool.wait_loaded(slot)
        else:
            pool.finish_read(slot)  # a read from disk lands, its copy queued
            self.unready.append((pool, slot))

    def ready(self) -> None:
        """Make the current stream wait for every load :meth:`place` left unwaited."""
        unready, self.unready = self.unready or [], None
        for pool, slot in unready:
            pool.wait_loaded(slot)

    def teardown(self, storage: HostStorage, on_device: Sequence[torch.nn.Parameter]) -> None:
        """Undo everything :meth:`place` (or :meth:`pass_through`) did; raise for a damaged
        code found on the way (:class:`~shuttle.errors.CorruptCodeError`).
        """
        if self.compiler is not None:
            self.compiler.detach()
        if self.adapters is not None:
            self.adapters.detach()
        for streamer in self.streamers.values():
            streamer.detach()
        if self.layer_streamer is not None:
            self.layer_streamer.detach()
        for unit in storage.units:
            unit.bind_host()
        for pool in self.pools:
            pool.close()
        if self.device.type != "cpu" or os.environ.get(CPU_COPY_ENV) == "1":
            move(on_device, torch.device("cpu"))
        self.pools.clear()  # closed: later work waits for their copies, awaited or not
        self.unready = None
        self.streamers.clear()
        self.placed.clear()
        self.layer_streamer = self.compiler = None
        decoder, self.decoder = self.decoder, None
        if decoder is not None:
            decoder.check()  # after the slots' copies were ordered before later work


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream_of(device: torch.device) -> torch.cuda.Stream:
    """The side stream for copies to ``device``, one per device for every activation.

    A fresh stream per activation would cost device memory outside any plan: cuBLAS keeps a
    workspace (tens of MB, from the caching allocator, for the process's life) for every stream
    a matmul ran on, and merge-mode adapters run matmuls on the copy stream. Activations that
    share it are ordered by their slots' events as before; their copies queue on one engine.
    """
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def move(params: Sequence[torch.nn.Parameter], device: torch.device) -> None:
    """Point each parameter (and its gradient) at a copy on ``device``; identity kept."""
    with torch.no_grad():
        for p in params:
            if p.device != device:
                p.data = p.data.to(device)
                if p.grad is not None:
                    p.grad = p.grad.to(device)
