"""Streaming one block group through a fixed ring of device slots.

Resident blocks are loaded once at activation into slots of their own (the offloader's); a
group's ring is a :class:`~shuttle.offload.slots.SlotPool` of ``k`` streaming slots. When the
group's blocks differ (T5's first block holds the relative attention bias), the ring's slots
are as large as its largest streamed block and a block occupies the front of a slot
(:meth:`~shuttle.offload.slots.SlotPool.for_layouts`). With ``d`` the prefetch depth
(``k = d + 1``), the hook around block ``i``'s forward does:

1. make sure block ``i`` is in a ring slot (a miss loads it now), make the compute stream wait
   for that slot's copy event, and point the block's parameters at the slot's views;
2. queue the loads of the next ``d`` streamed blocks the step will call (see below) into the
   least recently loaded slots that none of ``i`` and those ``d`` holds;
3. run the forward, then record the slot's free event (also when the forward raises).

Resident blocks get the hook too: they only prefetch, so the copy stream keeps working while
they compute. Everything here is host-side bookkeeping over fixed lists; the only device work
is the pool's copies and event records/waits.

Streamed blocks' parameters point at a slot only while it holds them: read them inside the
block's forward, not from outside during an activation.

**Backward.** Autograd reads a block's weights again in its backward, usually after later
blocks reused its slot, so training through streamed blocks needs activation checkpointing
(``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``): the backward then
recomputes the block's forward, which calls the hook again and reloads the block, and the
block's own backward follows at once, while its slot is protected. During the backward the
prefetch runs the other way (blocks ``i-1 .. i-d``), and a slot's free event is recorded at the
next hook call rather than at the end of the recomputation, so that it also covers the kernels
of the block's backward, queued between the two.

**What comes after the last block** depends on the step. An inference forward is followed by
the next step's forward: the last blocks prefetch the first ones (cyclic). A checkpointed
training forward is followed by its backward, which recomputes the last blocks first: the
ring already holds them, so the last blocks prefetch nothing new. A backward is followed by
the next step's forward, which starts where the backward ends: block 0, then 1, 2, ... Each
wrong guess at a turn costs ``d`` wasted copies on the critical path (the copies of a
copy-bound forward), four turns a training step.

A forward that records autograd outside checkpointing is not refused (its outputs are right),
but every tensor it saves that lies in a slot is checked when the backward unpacks it
(:class:`SlotGuard`): if the slot holds another block by then, the backward raises
:class:`~shuttle.errors.CheckpointRequiredError` instead of reading the wrong weights.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from shuttle.errors import ActivationError, CheckpointRequiredError
from shuttle.hooks import HookGroup, ModuleHook
from shuttle.offload.host_unit import HostUnit
from shuttle.offload.slots import SlotPool

__all__ = ["BlockStreamer", "SlotGuard", "SlotHook", "Streamer", "in_backward",
           "outer_saved_hooks"]


def in_backward() -> bool:
    """Whether the caller runs inside an autograd backward (a checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


def outer_saved_hooks() -> bool:
    """Whether saved-tensor hooks are active (non-reentrant checkpointing, ``save_on_cpu``)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class _Saved(NamedTuple):
    position: int  # the unit that was in the slot when the tensor was saved
    slot: int
    tensor: torch.Tensor


class Streamer(Protocol):
    """A ring of device slots that modules' weights stream through as the modules are called:
    :class:`BlockStreamer` (a block group) and
    :class:`~shuttle.offload.layer_streamer.LayerStreamer` (layers). What its hooks
    (:class:`SlotHook`), its saved-tensor guard (:class:`SlotGuard`), the offloader and a training
    step's host update (:func:`~shuttle.offload.training.host_step`) ask of it. Positions ``i``
    index its modules and their host units alike.
    """

    pool: SlotPool
    units: list[HostUnit]
    guard: SlotGuard
    loads: int  # loads queued so far (host-side counter, for tests and reports)

    def warm(self) -> None:
        """Queue the loads of the first streamed modules (as many as the ring holds)."""

    def attach(self) -> None:
        """Install a :class:`SlotHook` on every module (undone exactly by :meth:`detach`)."""

    def detach(self) -> None:
        """Remove every hook this streamer installed."""

    def invalidate(self) -> None:
        """Forget what the slots hold (the host copies changed) and queue the first loads."""

    def guarded(self, i: int, args: tuple, kwargs: dict) -> bool:
        """Whether module ``i``'s forward runs under :attr:`guard`."""

    def before(self, i: int) -> None:
        """Module ``i`` is about to run: its weights in place, the next ones on their way."""

    def after(self, i: int) -> None:
        """Module ``i``'s forward has been queued: its slot may be reused after it."""

    def slot_of(self, i: int) -> int | None:
        """The slot that holds module ``i`` now (None: none, or it is resident elsewhere)."""

    def release_later(self, slot: int) -> None:
        """Free ``slot`` at the next hook call rather than now: a backward reads it, and its
        kernels are queued after this point.
        """


class SlotGuard:
    """Saved-tensor hooks that check at backward time that a saved slot view is still valid.

    A tensor saved during unit ``i``'s forward whose storage is one of the streamer's pool's
    slots is packed with ``(i, slot)``; unpacking it raises :class:`CheckpointRequiredError`
    unless that slot still holds unit ``i`` (:meth:`Streamer.slot_of`), and frees the slot
    again after the backward's kernels (:meth:`Streamer.release_later`).

    The guard holds its streamer weakly: the streamer owns the guard, and a strong reference
    back would make a cycle that keeps an ended activation (its pools, its adapters' device
    factors) alive until the garbage collector runs. A saved tensor unpacked after the
    activation ended raises :class:`ActivationError` (its slot can no longer be checked).

    Args:
        streamer: the streamer whose slots are checked.
    """

    def __init__(self, streamer: Streamer):
        self._streamer = weakref.ref(streamer)
        buffers = streamer.pool.buffers
        self.slots = {b.untyped_storage().data_ptr(): k for k, b in enumerate(buffers)}

    @property
    def streamer(self) -> Streamer | None:
        """The guarded streamer; None once it is gone (its activation ended)."""
        return self._streamer()

    def hooks(self, i: int) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks for unit ``i``'s forward."""
        def pack(t: torch.Tensor) -> Any:
            slot = self.slots.get(t.untyped_storage().data_ptr())
            return t if slot is None else _Saved(i, slot, t)

        return torch.autograd.graph.saved_tensors_hooks(pack, self.unpack)

    def unpack(self, x: Any) -> torch.Tensor:
        """The saved tensor, checked (see the class)."""
        if not isinstance(x, _Saved):
            return x
        s = self.streamer
        if s is None:
            raise ActivationError(
                "the backward reads streamed weights saved by a forward whose activation has "
                "ended: run the backward inside the activation (before deactivate() or the end "
                "of the use() block)")
        if s.slot_of(x.position) != x.slot:
            raise CheckpointRequiredError(
                f"the backward reads weights of {s.units[x.position].name} from a device slot "
                "that was refilled since its forward: wrap each streamed block in "
                "torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False) (layer mode: "
                "keep the layers resident, or train with blocks=), or run under torch.no_grad()"
            )
        s.release_later(x.slot)
        return x.tensor


class SlotHook(ModuleHook):
    """The hook of one streamed module (a block, or a layer in layer mode): its weights bound
    before its forward (``before``), released after (``after``), and the forward run under the
    streamer's saved-tensor guard when ``guarded`` says so.
    """

    def __init__(self, streamer: Streamer, position: int):
        self.streamer = streamer
        self.position = position

    def forward(self, module: torch.nn.Module, inner: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
        # Wrapping forward (not pre/post) so the slot is released even if the forward raises.
        s, i = self.streamer, self.position
        s.before(i)
        try:
            if s.guarded(i, args, kwargs):
                with s.guard.hooks(i):
                    return inner(*args, **kwargs)
            return inner(*args, **kwargs)
        finally:
            s.after(i)


def _first(n: int, skip: int, *orders: Sequence[int]) -> tuple[int, ...]:
    """The first ``n`` distinct entries of the concatenated ``orders`` other than ``skip``."""
    out: list[int] = []
    for order in orders:
        for j in order:
            if len(out) == n:
                return tuple(out)
            if j != skip and j not in out:
                out.append(j)
    return tuple(out)


class BlockStreamer:
    """Moves one group's blocks through its pool's ring of slots as the blocks are called.

    Args:
        blocks: the group's modules, in call order.
        units: their host units (same order).
        pool: the group's ring (a pool of mixed layouts when its blocks differ).
        resident: positions of the blocks kept on the device elsewhere (already loaded and
            bound); they prefetch but are never loaded here.
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
        self._slot_of: list[int | None] = [None] * n  # streamed position -> its ring slot
        for pos in resident:
            self._resident[pos] = True
        streamed = [i for i in range(n) if not self._resident[i]]
        self._ring = list(range(pool.n_slots))
        self._owner: list[int | None] = [None] * len(self._ring)
        self._cursor = 0
        depth = min(prefetch, len(self._ring) - 1, len(streamed) - 1) if streamed else 0
        assert not streamed or self._ring, "streamed blocks need at least one ring slot"
        # The blocks to prefetch at block i: the next `depth` distinct streamed blocks of the
        # call sequence that follows (module docs), for an inference forward (cyclic), a
        # checkpointed training forward (then its backward, last block first) and a backward
        # (then the next forward, first block first).
        self._ahead: list[tuple[int, ...]] = []
        self._bounce: list[tuple[int, ...]] = []
        self._behind: list[tuple[int, ...]] = []
        for i in range(n):
            nxt = bisect.bisect_right(streamed, i)
            prv = bisect.bisect_left(streamed, i)
            self._ahead.append(_first(depth, i, streamed[nxt:], streamed[:nxt]))
            self._bounce.append(_first(depth, i, streamed[nxt:], streamed[::-1]))
            self._behind.append(_first(depth, i, streamed[:prv][::-1], streamed))
        self._protect = [frozenset((i, *a)) for i, a in enumerate(self._ahead)]
        self._protect_bounce = [frozenset((i, *a)) for i, a in enumerate(self._bounce)]
        self._protect_back = [frozenset((i, *a)) for i, a in enumerate(self._behind)]
        self._streamed = streamed
        self._pending: list[int] = []  # slots freed at the next hook call (see before())
        self.guard = SlotGuard(self)
        self._hooks = HookGroup()

    def warm(self) -> None:
        """Queue the loads of the first streamed blocks (as many as the ring holds)."""
        self._flush()
        first = frozenset(self._streamed[:len(self._ring)])
        for j in self._streamed[:len(self._ring)]:
            self._load(j, first)

    def attach(self) -> None:
        """Install the hook on every block (undone exactly by :meth:`detach`)."""
        for i, block in enumerate(self.blocks):
            hook = SlotHook(self, i)
            self._hooks.add(block, hook, outermost=True)  # binds weights first

    def detach(self) -> None:
        """Remove every hook this streamer installed."""
        self._hooks.remove_all()

    def invalidate(self) -> None:
        """Forget what the ring holds (the host copies changed) and queue the first loads."""
        for pos in self._streamed:
            self._slot_of[pos] = None
        self._owner = [None] * len(self._ring)
        self.warm()

    def guarded(self, i: int, args: tuple = (), kwargs: dict | None = None) -> bool:
        """Whether block ``i``'s forward runs under :attr:`guard` (grad mode, not checkpointed;
        the call's arguments matter only in layer mode).
        """
        return (not self._resident[i] and torch.is_grad_enabled() and not in_backward()
                and not outer_saved_hooks())

    def before(self, i: int) -> None:
        """Block ``i`` is about to run: its weights in place, the next ones on their way."""
        self._flush()
        if in_backward():
            order, protect = self._behind[i], self._protect_back[i]
        elif torch.is_grad_enabled() and outer_saved_hooks():  # its backward comes next
            order, protect = self._bounce[i], self._protect_bounce[i]
        else:
            order, protect = self._ahead[i], self._protect[i]
        if not self._resident[i]:
            slot = self._slot_of[i]
            if slot is None:  # a miss: out-of-order call, or no prefetch
                slot = self._load(i, protect)
            self.pool.wait_loaded(slot)
            self.units[i].bind(self.pool.views_of(slot, self.units[i]))
        for j in order:
            if self._slot_of[j] is None:
                self._load(j, protect)

    def after(self, i: int) -> None:
        """Block ``i``'s forward has been queued: its ring slot may be reused after it."""
        slot = self._slot_of[i]
        if not self._resident[i] and slot is not None:
            if in_backward():  # its backward is still to come: free it at the next hook
                self.release_later(slot)
            else:
                self.pool.release(slot)

    def slot_of(self, i: int) -> int | None:
        """The ring slot that holds block ``i`` now (None: none, or it is resident)."""
        return self._slot_of[i]

    def release_later(self, slot: int) -> None:
        """Free ``slot`` at the next hook call (a backward's kernels read it until then)."""
        if slot not in self._pending:
            self._pending.append(slot)

    def _flush(self) -> None:
        # A recomputation's slot is freed only now: the block's backward kernels, queued
        # after the recomputation returned, are before this point on the compute stream.
        while self._pending:
            self.pool.release(self._pending.pop())

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
