"""The optimizer step of an offloaded model: trainable weights are updated in host storage.

During an activation a trainable parameter's ``.data`` is a view of a device slot, and its
``.grad`` lands on the device. The host copy is the weight of record (a streamed block is
loaded from it again; ``deactivate`` points back at it), so :func:`host_step` makes the
optimizer update the host copy:

1. before the step, every trainable parameter is pointed at its host view and its gradient is
   copied to the host (one device-to-host copy per parameter: this synchronizes, once per
   step, by nature: the host optimizer reads the gradients);
2. the optimizer runs over host tensors (its state, created on first use, lives on the host
   too, so it stays valid whatever the next activation keeps on the device);
3. after it, every unit that is kept on the device for the activation (the rest, resident
   blocks and layers, the whole model) and holds a trainable parameter is copied again into
   its slot (merge-mode adapters folded again), and every streamer forgets its slots, so the
   next streamed load reads the updated host weights.

Under a host ceiling, a unit holding a trainable parameter must be in host memory for the step
(a unit on disk has no host copy to update: :class:`~shuttle.errors.StreamModeError`, before
anything moves), and after the step it stays there for good: its host copy, not its file, is
the weight of record now.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from shuttle.errors import PendingGradientError, StreamModeError
from shuttle.offload.host_storage import HostStorage
from shuttle.offload.host_unit import HostUnit
from shuttle.offload.slots import SlotPool
from shuttle.offload.streamer import Streamer
from shuttle.weights.dtensor import is_dtensor

__all__ = ["host_step", "trainable_units"]


def trainable_units(storage: HostStorage) -> list[tuple[HostUnit, list[torch.nn.Parameter]]]:
    """Units holding a parameter with ``requires_grad``, with those parameters (each once)."""
    out = []
    for unit in storage.units:
        seen: dict[int, torch.nn.Parameter] = {}
        for b in unit.bindings:
            p = b.module._parameters[b.name] if b.is_param else None
            if p is not None and p.requires_grad:
                seen.setdefault(id(p), p)
        if seen:
            out.append((unit, list(seen.values())))
    return out


@contextlib.contextmanager
def host_step(storage: HostStorage, resident: Sequence[tuple[SlotPool, int, HostUnit]],
              streamers: Sequence[Streamer], merged: frozenset[str]) -> Iterator[None]:
    """Point trainable parameters (and their gradients) at the host for the ``with`` body.

    Args:
        storage: the offloaded model's host storage.
        resident: ``(pool, slot, unit)`` for every unit placed on the device for the whole
            activation; those with trainable parameters are copied again after the step.
        streamers: the activation's block and layer streamers.
        merged: names of units that a merge-mode adapter folds into.

    Raises:
        StreamModeError: a trainable parameter lies in a unit that a merge-mode adapter
            changes (its device weight is not its host weight), or is a DTensor; raised before
            anything moves.
        StreamModeError: a trainable parameter lies in a unit kept on disk (a host ceiling).
        PendingGradientError: gradients are left on trainable parameters after the body
            (clear them inside it); the parameters are back on the device all the same.
    """
    units = trainable_units(storage)
    folded = [u.name or "(the rest of the model)" for u, _ in units if u.name in merged]
    if folded:
        raise StreamModeError(
            f"trainable parameters in {folded[:4]} are folded with a merge-mode adapter, so "
            "the step would see merged weights: activate with mode='dynamic' to train "
            "beside an adapter, or freeze those parameters"
        )
    on_disk = [unit.name or "(the rest of the model)" for unit, _ in units if unit.on_disk]
    if on_disk:
        raise StreamModeError(
            f"trainable parameters in {on_disk[:4]}, which are kept on disk (max_host_bytes): "
            "an optimizer step on the host needs their host copies. Train adapters with "
            "from_module(..., trainable='device'), freeze those parameters, or raise "
            "max_host_bytes so that they stay in host memory")
    sharded = [unit.name or "(the rest of the model)" for unit, params in units
               if any(is_dtensor(p) for p in params)]
    if sharded:
        raise StreamModeError(
            f"trainable DTensor parameters in {sharded[:4]}: optimizer_step() updates host "
            "copies of whole tensors, not of shards; freeze them (requires_grad_(False)) or "
            "train them resident")
    for unit, params in units:
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None  # a gradient must match its parameter's device when assigned
        unit.bind_host()
        for p, g in zip(params, grads, strict=True):
            if g is not None:
                p.grad = g.to(p.device)
    failed = True
    for unit, _ in units:
        unit.spans = None  # its host copy becomes the weight of record: never dropped now
    try:
        yield
        failed = False
    finally:
        left = [p for _, params in units for p in params if p.grad is not None]
        keep = {id(u) for u, _ in units}
        for pool, slot, unit in resident:
            if id(unit) in keep:
                pool.release(slot)  # the copy waits for the slot's readers queued so far
                pool.load(slot, unit)
                pool.wait_loaded(slot)
                unit.bind(pool.views_of(slot, unit))
        for streamer in streamers:
            if any(id(u) in keep for u in streamer.units):
                streamer.invalidate()
        if left and not failed:
            raise PendingGradientError(
                f"{len(left)} trainable parameters still hold gradients after "
                "optimizer_step(); call optimizer.zero_grad() inside the block (the gradients "
                "live on the host, the parameters on the device)"
            )
