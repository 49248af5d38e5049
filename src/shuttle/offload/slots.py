"""A fixed pool of device buffers ("slots") for the units of one layout.

Every slot is one flat ``uint8`` buffer allocated at activation; a block's tensors are views into
it (:meth:`Layout.views`), so loading a block is one ``copy_`` and nothing is allocated while
streaming.

On CUDA, copies run on a side stream and ordering uses events only (no host synchronization):

    copy stream:     wait freed[s] -> copy host arena into slot s -> record loaded[s]
    compute stream:  wait loaded[s] -> the block's kernels -> record freed[s]

(a unit kept coded records ``loaded[s]`` on the decoder's stream, after its decode:
:mod:`~shuttle.offload.coded`)

so a slot is overwritten only after the kernels of its previous block were queued before
``freed[s]``, and a block's kernels start only after its bytes landed. Waiting on an event that
was never recorded is a no-op, which makes the first use of each slot free of special cases.

A pool made by :meth:`SlotPool.for_layouts` holds units of different layouts (the layers of
layer mode): each slot is as large as the largest, and a unit occupies the front of a slot
through views made once per (slot, unit) and kept.

A unit kept on disk (a host ceiling, :mod:`~shuttle.offload.disk_reader`) is loaded in two
steps: :meth:`SlotPool.load` queues its read into a staging buffer and returns; once the read
landed, the copy out of the buffer is queued as above (``wait freed[s]`` first, ``record
loaded[s]`` after the last chunk and the fold). Landed reads are turned into copies at every
call of :meth:`~SlotPool.load`, :meth:`~SlotPool.wait_loaded` and :meth:`~SlotPool.release`;
:meth:`~SlotPool.wait_loaded` waits on the host only for a read of its slot still in flight.
A load that failed (its file changed) makes every later wait on its slot raise, so the slot's
stale bytes are never used.

On other devices (the CPU test mode included) copies are plain synchronous ``copy_`` calls and
the events are absent; the bookkeeping around them is the same.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence

import torch

from shuttle.offload.coded import Decoder
from shuttle.offload.disk_reader import DiskLoad, DiskReader
from shuttle.offload.host_unit import HostUnit
from shuttle.offload.layout import Layout

__all__ = ["SlotPool"]


class SlotPool:
    """``n_slots`` device buffers laid out by ``layout``.

    Args:
        layout: the layout every unit loaded here shares.
        n_slots: how many buffers (fixed for the pool's life).
        device: where the buffers live.
        copy_stream: the CUDA side stream for copies; None for synchronous copies.
        fold: called as ``fold(unit, views)`` right after each copy lands in a slot, before
            the slot counts as loaded (on the copy stream on CUDA): merges adapters into the
            slot. The host copy is never passed, so every load starts pristine.
        decoder: the activation's :class:`~shuttle.offload.coded.Decoder`, for units kept
            coded (decoded into the slot before it counts as loaded).
    """

    def __init__(self, layout: Layout, n_slots: int, device: torch.device,
                 copy_stream: torch.cuda.Stream | None = None,
                 fold: Callable[[HostUnit, list[torch.Tensor]], None] | None = None,
                 decoder: Decoder | None = None):
        self.layout = layout
        self.fold = fold
        self.decoder = decoder
        self.device = device
        self.buffers = [torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
                        for _ in range(n_slots)]
        self.views = [layout.views(b) for b in self.buffers]
        self._stream = copy_stream
        cuda = copy_stream is not None
        if cuda:
            # The new buffers may reuse memory that queued compute kernels still touch.
            copy_stream.wait_stream(torch.cuda.current_stream(device))
        self._loaded = [torch.cuda.Event() if cuda else None for _ in range(n_slots)]
        self._freed = [torch.cuda.Event() if cuda else None for _ in range(n_slots)]
        # (slot, unit name) -> (flat, views) in a pool of mixed layouts; None: one layout.
        self._mixed: dict[tuple[int, str], tuple[torch.Tensor, list[torch.Tensor]]] | None = None
        self._disk: list[DiskLoad | None] = [None] * n_slots  # a slot's load from disk
        self._readers: dict[int, DiskReader] = {}  # the readers this pool loaded through

    @classmethod
    def for_layouts(cls, layouts: list[Layout], n_slots: int, device: torch.device,
                    copy_stream: torch.cuda.Stream | None = None,
                    fold: Callable[[HostUnit, list[torch.Tensor]], None] | None = None,
                    decoder: Decoder | None = None) -> SlotPool:
        """A pool whose slots can each hold a unit of any of ``layouts`` (sized to the largest).

        Args:
            layouts: the layouts of the units that will be loaded here.
            n_slots, device, copy_stream, fold, decoder: as for the constructor.

        Returns:
            The pool; use :meth:`views_of` for a unit's tensors in a slot.
        """
        capacity = max((lay.nbytes for lay in layouts), default=0)
        pool = cls(Layout((), (), (), capacity), n_slots, device, copy_stream, fold, decoder)
        pool._mixed = {}
        return pool

    def views_of(self, slot: int, unit: HostUnit) -> list[torch.Tensor]:
        """``unit``'s tensors as views of ``slot`` (made on first use, then reused)."""
        return self._target(slot, unit)[1]

    def _target(self, slot: int, unit: HostUnit) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self._mixed is None:
            return self.buffers[slot], self.views[slot]
        key = (slot, unit.name)
        target = self._mixed.get(key)
        if target is None:
            assert unit.layout.nbytes <= self.layout.nbytes, f"{unit.name} exceeds the slots"
            flat = self.buffers[slot][:unit.layout.nbytes]
            target = self._mixed[key] = (flat, unit.layout.views(flat))
        return target

    @property
    def n_slots(self) -> int:
        return len(self.buffers)

    @property
    def nbytes(self) -> int:
        """Device bytes held by the pool."""
        return self.layout.nbytes * len(self.buffers)

    def load(self, slot: int, unit: HostUnit) -> None:
        """Copy ``unit``'s host tensors into ``slot`` once the slot's last reader is done (a unit
        on disk: queue its read; the copy follows once the read landed).
        """
        self._settle(slot)
        if unit.on_disk:
            reader = unit.reader
            assert reader is not None
            self._readers[id(reader)] = reader
            self._disk[slot] = reader.submit(self, unit.spans,
                                             functools.partial(self._land, slot, unit))
            return
        self._pump()
        flat, views = self._target(slot, unit)
        if self._stream is None:
            unit.copy_into(flat, views, non_blocking=False, decoder=self.decoder)
            if self.fold is not None:
                self.fold(unit, views)
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._freed[slot])
            # From pinned memory this returns at once; the DMA runs on the side stream.
            done = unit.copy_into(flat, views, non_blocking=True, decoder=self.decoder)
            self._finish(slot, unit, views, done)

    def _finish(self, slot: int, unit: HostUnit, views: list[torch.Tensor],
                done: torch.cuda.Stream | None) -> None:
        """On CUDA, with the copy stream current: the fold, then ``loaded[slot]``, after the
        load's last work (on the copy stream, or a coded unit's decode stream ``done``).
        """
        assert self._stream is not None
        if self.fold is not None:  # ordered after the copy (and the decode) on the copy stream
            if done is not None:
                self.decoder.after_decode(self._stream)  # type: ignore[union-attr]
            self.fold(unit, views)
            done = None
        self._loaded[slot].record(done or self._stream)

    def wait_loaded(self, slot: int) -> None:
        """Make the current (compute) stream wait until ``slot``'s last load landed.

        Raises:
            FileChangedError: the slot's load from disk found its file changed (again on
                every later wait, until the slot is loaded anew).
            AdapterFileError: the slot's load from disk could not read its file.
        """
        self.finish_read(slot)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loaded[slot])

    def finish_read(self, slot: int) -> None:
        """The host's part of :meth:`wait_loaded`: a read of ``slot`` from disk still in
        flight is waited for and its copy queued (other landed reads' copies too); no stream
        is made to wait.

        Raises:
            FileChangedError, AdapterFileError: as :meth:`wait_loaded`.
        """
        pending = self._disk[slot]
        if pending is not None:
            pending.reader.finish(pending)  # raises while the load stays failed
            self._disk[slot] = None
        else:
            self._pump()

    def release(self, slot: int) -> None:
        """Mark ``slot`` reusable after the work queued so far on the current stream."""
        if self._stream is not None:
            self._freed[slot].record(torch.cuda.current_stream(self.device))
        self._pump()

    def _pump(self) -> None:
        for reader in self._readers.values():
            reader.pump()

    def _settle(self, slot: int) -> None:
        """Before ``slot`` is loaded again: a load of it from disk still pending lands first
        (its copy would land after the new one otherwise); a failed one is forgotten.
        """
        pending, self._disk[slot] = self._disk[slot], None
        if pending is not None and not pending.done:
            with contextlib.suppress(Exception):  # the slot is refilled: its error is moot
                pending.reader.finish(pending)

    def _land(self, slot: int, unit: HostUnit, buffer: torch.Tensor, copies: Sequence,
              first: bool, last: bool, staged: torch.cuda.Event | None) -> None:
        """Queue the copies of one chunk of ``unit`` out of staging ``buffer`` into ``slot``;
        ``staged`` is recorded after them (the buffer may be read into again).
        """
        flat, views = self._target(slot, unit)
        # a coded unit lands in the decoder's staging buffer (in one piece: the host plan sizes
        # the staging ring so), decoded into the slot at the end
        assert unit.code is None or (first and last), f"{unit.name} read in pieces"
        decoder = self.decoder
        if unit.code is not None:
            assert decoder is not None, f"{unit.name} is coded"
        if self._stream is None:
            j, to = decoder.stage() if unit.code is not None else (0, flat)  # type: ignore[union-attr]
            for c in copies:
                to[c.to:c.to + c.n].copy_(buffer[c.at:c.at + c.n])
            if last:
                for i, t in unit.side.items():
                    views[i].copy_(t)
            if last and unit.code is not None:
                decoder.decode(j, unit.code, unit.layout, flat, views)  # type: ignore[union-attr]
            if last and self.fold is not None:
                self.fold(unit, views)
            return
        with torch.cuda.stream(self._stream):
            if first:
                self._stream.wait_event(self._freed[slot])
            j, to = decoder.stage() if unit.code is not None else (0, flat)  # type: ignore[union-attr]
            for c in copies:  # from registered (pinned) memory: DMAs on the side stream
                to[c.to:c.to + c.n].copy_(buffer[c.at:c.at + c.n], non_blocking=True)
            assert staged is not None
            staged.record(self._stream)
            if last:
                for i, t in unit.side.items():  # after every run (one may span a side entry)
                    views[i].copy_(t, non_blocking=True)
                done = None
                if unit.code is not None:
                    done = decoder.decode(j, unit.code, unit.layout, flat, views)  # type: ignore[union-attr]
                self._finish(slot, unit, views, done)

    def close(self) -> None:
        """Drop the buffers; later work on the current stream is ordered after every copy.

        The caching allocator hands freed memory to the stream it was allocated on (the
        current one), so it must not be reused before copies still in flight on the side
        stream (a prefetch for the next step) have finished; ``wait_stream`` orders that on
        the device, without a host synchronization.
        """
        for reader in self._readers.values():
            reader.drain(self)  # reads in flight end before their buffers are reused
        self._disk = [None] * len(self._disk)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        if self.decoder is not None:  # decodes in flight write into these slots
            self.decoder.join()
        self.buffers, self.views = [], []
        if self._mixed is not None:
            self._mixed.clear()
