"""Streaming one block group through a fixed ring of device slots.

A group's :class:`~shuttle.offload.slots.SlotPool` holds ``r`` resident slots (one per resident
block, loaded once at activation) followed by a ring of ``k`` streaming slots. With ``d`` the
prefetch depth (``k = d + 1``), the hook around block ``i``'s forward does:

1. make sure block ``i`` is in a ring slot (a miss loads it now), make the compute stream wait
   for that slot's copy event, and point the block's parameters at the slot's views;
2. queue the loads of the next ``d`` streamed blocks after ``i`` (cyclically: the last blocks
   of a step prefetch the first ones of the next step) into the least recently loaded slots
   that none of ``i``, ``i+1 .. i+d`` holds;
3. run the forward, then record the slot's free event (also when the forward raises).

Resident blocks get the hook too: they only prefetch, so the copy stream keeps working while
they compute. Everything here is host-side bookkeeping over fixed lists; the only device work
is the pool's copies and event records/waits.

Streamed blocks' parameters point at a slot only while it holds them: read them inside the
block's forward, not from outside during an activation.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shuttle.hooks import ModuleHook, add_hook, remove_hook
from shuttle.offload.host_storage import HostUnit
from shuttle.offload.slots import SlotPool

__all__ = ["BlockStreamer"]


class _StreamHook(ModuleHook):
    def __init__(self, streamer: BlockStreamer, position: int):
        self.streamer = streamer
        self.position = position

    def forward(self, module: torch.nn.Module, inner: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
        # Wrapping forward (not pre/post) so the slot is released even if the forward raises.
        self.streamer.before(self.position)
        try:
            return inner(*args, **kwargs)
        finally:
            self.streamer.after(self.position)


class BlockStreamer:
    """Moves one group's blocks through its pool's ring of slots as the blocks are called.

    Args:
        blocks: the group's modules, in call order.
        units: their host units (same order).
        pool: the group's slots: ``len(resident)`` resident slots, then the ring.
        resident: positions of the blocks kept in the resident slots (already loaded and bound).
        prefetch: how many streamed blocks to load ahead (clamped to the ring).

    Attributes:
        loads: how many block loads were queued (host-side counter, for tests and reports).
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], units: Sequence[HostUnit],
                 pool: SlotPool, resident: Sequence[int], prefetch: int):
        n = len(blocks)
        self.blocks = list(blocks)
        self.units = list(units)
        self.pool = pool
        self.loads = 0
        self._resident = [False] * n
        self._slot_of: list[int | None] = [None] * n
        for slot, pos in enumerate(resident):
            self._resident[pos] = True
            self._slot_of[pos] = slot
        streamed = [i for i in range(n) if not self._resident[i]]
        self._ring = list(range(len(resident), pool.n_slots))
        self._owner: list[int | None] = [None] * len(self._ring)
        self._cursor = 0
        depth = min(prefetch, len(self._ring) - 1, len(streamed) - 1) if streamed else 0
        assert not streamed or self._ring, "streamed blocks need at least one ring slot"
        self._ahead: list[tuple[int, ...]] = []
        for i in range(n):
            nxt = bisect.bisect_right(streamed, i)
            self._ahead.append(tuple(streamed[(nxt + d) % len(streamed)] for d in range(depth)))
        self._protect = [frozenset((i, *a)) for i, a in enumerate(self._ahead)]
        self._streamed = streamed
        self._hooks: list[tuple[torch.nn.Module, _StreamHook]] = []

    def warm(self) -> None:
        """Queue the loads of the first streamed blocks (as many as the ring holds)."""
        first = frozenset(self._streamed[:len(self._ring)])
        for j in self._streamed[:len(self._ring)]:
            self._load(j, first)

    def attach(self) -> None:
        """Install the hook on every block (undone exactly by :meth:`detach`)."""
        for i, block in enumerate(self.blocks):
            hook = _StreamHook(self, i)
            add_hook(block, hook)
            self._hooks.append((block, hook))

    def detach(self) -> None:
        """Remove every hook this streamer installed."""
        while self._hooks:
            block, hook = self._hooks.pop()
            remove_hook(block, hook)

    def before(self, i: int) -> None:
        """Block ``i`` is about to run: its weights in place, the next ones on their way."""
        protect = self._protect[i]
        if not self._resident[i]:
            slot = self._slot_of[i]
            if slot is None:  # a miss: out-of-order call, or no prefetch
                slot = self._load(i, protect)
            self.pool.wait_loaded(slot)
            self.units[i].bind(self.pool.views[slot])
        for j in self._ahead[i]:
            if self._slot_of[j] is None:
                self._load(j, protect)

    def after(self, i: int) -> None:
        """Block ``i``'s forward has been queued: its ring slot may be reused after it."""
        slot = self._slot_of[i]
        if not self._resident[i] and slot is not None:
            self.pool.release(slot)

    def _load(self, j: int, protect: frozenset[int]) -> int:
        k = len(self._ring)
        for step in range(k):
            r = (self._cursor + step) % k
            if self._owner[r] is None or self._owner[r] not in protect:
                break
        else:  # pragma: no cover - k = depth + 1 >= len(protect) leaves a slot free
            raise AssertionError(f"no free ring slot for block {j} (protected {set(protect)})")
        previous = self._owner[r]
        if previous is not None:
            self._slot_of[previous] = None
        self._owner[r] = None  # empty until the copy is queued (a failing copy leaves it so)
        slot = self._ring[r]
        self.pool.load(slot, self.units[j])
        self._owner[r], self._slot_of[j] = j, slot
        self._cursor = (r + 1) % k
        self.loads += 1
        return slot
