"""Layer mode: each layer's weights streamed to the device just before the layer runs.

For models without block lists. A *layer* is a leaf module with parameters of its own (a
Linear, a Conv, a norm, an embedding); its parameters are one host unit, its buffers stay with
the rest of the model (resident). The streamed layers share one
:class:`~shuttle.offload.slots.SlotPool` of ``prefetch + 1`` slots, each as large as the
largest streamed layer, so a model of any shape streams through a fixed amount of device
memory and nothing is allocated per layer.

The hook around layer ``i`` does, host-side only:

1. learn the call order: the layer called before ``i`` gets ``i`` as its successor (the table
   starts in registration order, so the first forward already prefetches sensibly, and it
   follows the real order from then on, including the wrap from the last layer of a step to
   the first of the next);
2. make sure ``i`` is in a slot (a miss loads it now), make the compute stream wait for that
   slot's copy event, point the layer's parameters at the slot's views;
3. queue the loads of the next ``prefetch`` streamed layers along the successor chain into
   slots that none of them, nor ``i``, holds;
4. run the forward, then record the slot's free event (also when it raises).

The ordering between the copy stream and the compute stream is the pool's two events per slot
(see :mod:`~shuttle.offload.slots`): no host synchronization, no allocation.

Layer mode is for inference. A layer's weights are read again by the backward, normally long
after its slot was refilled: the tensors a streamed layer saves for the backward are checked
when unpacked (:class:`~shuttle.offload.streamer.SlotGuard`), and reading a refilled slot raises
:class:`~shuttle.errors.CheckpointRequiredError` rather than giving wrong gradients (resident
layers train normally). Under activation checkpointing (a recomputation, or any saved-tensor
hooks) a streamed layer that records autograd raises at once: a checkpointed region recomputes
many layers before their backward, so their slots would not survive (train with ``blocks=``
and checkpoint each block instead).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shuttle.errors import CheckpointRequiredError
from shuttle.hooks import HookGroup
from shuttle.offload.host_unit import HostUnit
from shuttle.offload.slots import SlotPool
from shuttle.offload.streamer import SlotGuard, SlotHook, in_backward, outer_saved_hooks

__all__ = ["LayerStreamer"]


class LayerStreamer:
    """Moves layers of different shapes through one pool of equal slots as they are called.

    Args:
        layers: the layer modules, in registration order.
        units: their host units (same order).
        pool: the ring, from :meth:`SlotPool.for_layouts` over the streamed layers' layouts.
        resident: positions of layers that the offloader keeps on the device (already loaded
            and bound); they learn the order and prefetch but are never loaded here.
        prefetch: how many streamed layers to load ahead (clamped to the ring).

    Attributes:
        loads: how many layer loads were queued (host-side counter, for tests and reports).
        misses: how many of them were for the layer about to run (not prefetched in time).
    """

    def __init__(self, layers: Sequence[torch.nn.Module], units: Sequence[HostUnit],
                 pool: SlotPool, resident: Sequence[int], prefetch: int):
        n = len(layers)
        self.layers = list(layers)
        self.units = list(units)
        self.pool = pool
        self.loads = 0
        self.misses = 0
        self._resident = [False] * n
        for pos in resident:
            self._resident[pos] = True
        self._streamed = [i for i in range(n) if not self._resident[i]]
        self._slot_of: list[int | None] = [None] * n
        self._owner: list[int | None] = [None] * pool.n_slots
        self._cursor = 0
        self._depth = min(prefetch, pool.n_slots - 1, len(self._streamed) - 1)
        self._next = [(i + 1) % n for i in range(n)]  # successor table, learned as it runs
        self._last: int | None = None
        self._pending: list[int] = []  # slots a backward read: freed at the next hook call
        self.guard = SlotGuard(self)
        self._hooks = HookGroup()

    def warm(self) -> None:
        """Queue the loads of the first streamed layers (as many as the ring holds)."""
        first = self._streamed[:self.pool.n_slots]
        for j in first:
            self._load(j, frozenset(first))

    def attach(self) -> None:
        """Install the hook on every layer (undone exactly by :meth:`detach`)."""
        for i, layer in enumerate(self.layers):
            hook = SlotHook(self, i)
            self._hooks.add(layer, hook, outermost=True)  # binds weights first

    def detach(self) -> None:
        """Remove every hook this streamer installed."""
        self._hooks.remove_all()

    def invalidate(self) -> None:
        """Forget what the slots hold (the host copies changed) and queue the first loads."""
        while self._pending:
            self.pool.release(self._pending.pop())
        self._slot_of = [None] * len(self.layers)
        self._owner = [None] * self.pool.n_slots
        self.warm()

    def guarded(self, i: int, args: tuple, kwargs: dict) -> bool:
        """Whether layer ``i``'s forward runs under :attr:`guard` (streamed, in grad mode).

        Raises:
            CheckpointRequiredError: a streamed layer records autograd under checkpointing.
        """
        if self._resident[i] or not torch.is_grad_enabled():
            return False
        if not (in_backward() or outer_saved_hooks()):
            return True
        if (any(p.requires_grad for p in self.layers[i].parameters())
                or any(isinstance(a, torch.Tensor) and a.requires_grad
                       for a in (*args, *kwargs.values()))):
            raise CheckpointRequiredError(
                f"layer {self.units[i].name} streams in layer mode under activation "
                "checkpointing: a recomputed region refills the layers' slots before their "
                "backward. Stream blocks (blocks=...) and checkpoint each block, keep the "
                "layers resident, or run under torch.no_grad()"
            )
        return False

    def before(self, i: int) -> None:
        """Layer ``i`` is about to run: its weights in place, the next ones on their way."""
        while self._pending:  # a backward read these slots: free them after its kernels
            self.pool.release(self._pending.pop())
        if self._last is not None:
            self._next[self._last] = i
        self._last = i
        ahead = self._ahead(i)
        protect = frozenset((i, *ahead))
        if not self._resident[i]:
            slot = self._slot_of[i]
            if slot is None:
                self.misses += 1
                slot = self._load(i, protect)
            self.pool.wait_loaded(slot)
            self.units[i].bind(self.pool.views_of(slot, self.units[i]))
        for j in ahead:
            if self._slot_of[j] is None:
                self._load(j, protect)

    def after(self, i: int) -> None:
        """Layer ``i``'s forward has been queued: its slot may be reused after it."""
        slot = self._slot_of[i]
        if not self._resident[i] and slot is not None:
            self.pool.release(slot)

    def slot_of(self, i: int) -> int | None:
        """The slot that holds layer ``i`` now (None: none, or it is resident)."""
        return self._slot_of[i]

    def release_later(self, slot: int) -> None:
        """Free ``slot`` at the next hook call (a backward's kernels read it until then)."""
        if slot not in self._pending:
            self._pending.append(slot)

    def _ahead(self, i: int) -> tuple[int, ...]:
        # The next `depth` streamed layers along the learned order (at most one lap).
        out: list[int] = []
        j = i
        for _ in range(len(self.layers)):
            if len(out) == self._depth:
                break
            j = self._next[j]
            if j == i:
                break
            if not self._resident[j] and j not in out:
                out.append(j)
        return tuple(out)

    def _load(self, j: int, protect: frozenset[int]) -> int:
        k = self.pool.n_slots
        for step in range(k):
            r = (self._cursor + step) % k
            if self._owner[r] is None or self._owner[r] not in protect:
                break
        else:  # pragma: no cover - k >= depth + 1 = len(protect) leaves a slot free
            raise AssertionError(f"no free slot for layer {j} (protected {set(protect)})")
        previous = self._owner[r]
        if previous is not None:
            self._slot_of[previous] = None
        self._owner[r] = None  # empty until the copy is queued (a failing copy leaves it so)
        self.pool.load(r, self.units[j])
        self._owner[r], self._slot_of[j] = j, r
        self._cursor = (r + 1) % k
        self.loads += 1
        return r
