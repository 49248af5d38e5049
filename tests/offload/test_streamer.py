"""Both streamers are a :class:`~shuttle.offload.streamer.Streamer`: what the slot hooks, the
saved-tensor guard, the offloader and a training step's host update call is there on each, and
the guard reads a streamer's slots through it (never its private state)."""

from __future__ import annotations

import gc
import inspect
from types import SimpleNamespace

import pytest
import torch

from shuttle.errors import ActivationError, CheckpointRequiredError
from shuttle.offload import ModelOffloader, StreamConfig
from shuttle.offload.streamer import SlotGuard, Streamer
from tests.offload.models import TinyDiT
from tests.offload.test_layer_mode import ConvNet, images

METHODS = sorted(n for n, v in vars(Streamer).items()
                 if inspect.isfunction(v) and not n.startswith("_"))
ATTRIBUTES = sorted(Streamer.__annotations__)


def _streamers():
    blocks = ModelOffloader.from_module(TinyDiT(), blocks=["blocks", "single"])
    layers = ModelOffloader.from_module(ConvNet().eval(), layers=True)
    with blocks.use("cpu", StreamConfig(prefetch=1)) as m, torch.no_grad():
        m(torch.randint(0, 64, (2, 9)))
        got = list(blocks.streamers.values())
    with layers.use("cpu", StreamConfig(prefetch=1)) as m, torch.no_grad():
        m(images())
        got.append(layers.layer_streamer)
    return got


def test_both_streamers_have_every_member_of_the_protocol(cpu_copy):
    assert {"slot_of", "release_later", "before", "after", "guarded"} <= set(METHODS)
    streamers = _streamers()
    assert {type(s).__name__ for s in streamers} == {"BlockStreamer", "LayerStreamer"}
    for s in streamers:
        missing = [n for n in METHODS if not callable(getattr(s, n, None))]
        missing += [n for n in ATTRIBUTES if not hasattr(s, n)]
        assert not missing, (type(s).__name__, missing)
        assert isinstance(s.guard, SlotGuard) and s.guard.streamer is s


class _Ring:
    """A streamer with nothing but what the guard may ask: its pool, units and slots."""

    def __init__(self, held: dict[int, int]):
        self.pool = SimpleNamespace(buffers=[torch.zeros(4), torch.zeros(4)])
        self.units = [SimpleNamespace(name="blocks.0"), SimpleNamespace(name="blocks.1")]
        self.held, self.later = held, []

    def slot_of(self, i: int) -> int | None:
        return self.held.get(i)

    def release_later(self, slot: int) -> None:
        self.later.append(slot)


def test_the_guard_reads_a_streamer_through_the_protocol_only():
    ring = _Ring({0: 1})
    guard = SlotGuard(ring)  # type: ignore[arg-type]
    saved = ring.pool.buffers[1][:2]  # a view into slot 1, saved while unit 0 held it
    pack, unpack = guard.hooks(0).pack_hook, guard.hooks(0).unpack_hook
    packed = pack(saved)
    assert unpack(packed) is saved and ring.later == [1]  # still there: freed after backward
    ring.held = {1: 1}  # slot 1 refilled with unit 1
    with pytest.raises(CheckpointRequiredError, match="blocks.0 from a device slot"):
        unpack(pack(saved))
    assert pack(torch.zeros(2)) is not None  # a tensor outside the slots passes as is


def test_the_guard_holds_its_streamer_weakly():
    """The streamer owns its guard: a guard holding it strongly would make a cycle that keeps
    an ended activation alive until a collection. A saved view unpacked after the streamer is
    gone cannot be checked: the backward is refused."""
    ring = _Ring({0: 1})
    guard = SlotGuard(ring)  # type: ignore[arg-type]
    saved = ring.pool.buffers[1][:2]
    packed = guard.hooks(0).pack_hook(saved)
    gc.disable()
    try:
        del ring  # no collection: freed only if nothing refers to it
        with pytest.raises(ActivationError, match="activation has ended"):
            guard.unpack(packed)
    finally:
        gc.enable()
