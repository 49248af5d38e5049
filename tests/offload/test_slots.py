from __future__ import annotations

import pytest
import torch

from shuttle.hooks import hooks_of
from shuttle.offload import BlockStreamer, HostStorage, SlotPool
from tests.offload.models import Block


def storage_of(n=6, dim=16):
    blocks = torch.nn.ModuleList(Block(dim, 2 * dim) for _ in range(n))
    ref = [{k: v.clone() for k, v in b.state_dict().items()} for b in blocks]
    return blocks, HostStorage(blocks, {"": list(blocks)}), ref


def test_pool_loads_a_block_with_one_copy_and_views_match():
    blocks, storage, ref = storage_of()
    units = storage.groups[""]
    pool = SlotPool(units[0].layout, 2, torch.device("cpu"))
    assert pool.n_slots == 2 and pool.nbytes == 2 * units[0].layout.nbytes
    pool.load(1, units[4])
    units[4].bind(pool.views[1])
    for k, v in blocks[4].state_dict().items():
        assert torch.equal(v, ref[4][k])
        assert pool.buffers[1].data_ptr() <= v.data_ptr() < pool.buffers[1].data_ptr() + pool.nbytes
    units[4].bind_host()
    pool.close()
    assert pool.buffers == [] and pool.views == []


class Recorder(SlotPool):
    """A CPU pool that logs its operations."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.log: list[tuple[str, int, str | int]] = []

    def load(self, slot, unit):
        self.log.append(("load", slot, unit.name))
        super().load(slot, unit)

    def release(self, slot):
        self.log.append(("release", slot, -1))


def streamer_of(n, resident, prefetch):
    blocks, storage, ref = storage_of(n)
    units = storage.groups[""]
    streamed = n - len(resident)
    kept = SlotPool(units[0].layout, len(resident), torch.device("cpu"))  # the offloader's
    for slot, pos in enumerate(resident):
        kept.load(slot, units[pos])
        units[pos].bind(kept.views[slot])
    pool = Recorder(units[0].layout, min(prefetch + 1, streamed), torch.device("cpu"))
    s = BlockStreamer(blocks, units, pool, resident, prefetch)
    return blocks, s, pool, ref


def run(blocks, x):
    for b in blocks:
        x = b(x)
    return x


@pytest.mark.parametrize("resident,prefetch", [((), 0), ((), 2), ((1, 4), 1), ((0,), 3)])
def test_sequential_steps_load_each_streamed_block_once_per_step(resident, prefetch):
    n = 6
    blocks, s, pool, ref = streamer_of(n, resident, prefetch)
    x = torch.randn(3, 16)
    with torch.no_grad():
        want = run(blocks, x)  # host weights, no hooks yet
        s.attach()
        s.warm()
        deltas = []
        for _ in range(3):
            before = s.loads
            assert torch.equal(run(blocks, x), want)
            deltas.append(s.loads - before)
    # steady state (after the first step): every streamed block loaded exactly once per step
    assert deltas[1:] == [n - len(resident)] * 2
    s.detach()
    assert all(hooks_of(b) == [] for b in blocks)
    loaded = {unit for e, _, unit in pool.log if e == "load"}
    assert loaded == {f".{i}" for i in range(n) if i not in resident}  # the ring: streamed only


def test_ring_never_evicts_the_running_block_or_its_prefetches():
    blocks, s, pool, _ = streamer_of(7, (), 2)
    seen = []
    original = s.before

    def before(i):
        original(i)
        held = {o for o in s._owner if o is not None}
        seen.append((i, held))

    s.before = before
    s.attach()
    s.warm()
    with torch.no_grad():
        run(blocks, torch.randn(2, 16))
        run(blocks, torch.randn(2, 16))
    s.detach()
    for i, held in seen:
        assert {i, (i + 1) % 7, (i + 2) % 7} <= held


def test_out_of_order_calls_load_on_demand_and_stay_correct():
    blocks, s, pool, ref = streamer_of(5, (2,), 1)
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = run(list(blocks)[::-1], x)
        s.attach()
        s.warm()
        assert torch.equal(run(list(blocks)[::-1], x), want)
        assert torch.equal(run(list(blocks)[::2], x), run_plain(ref, [0, 2, 4], x))
    s.detach()


def run_plain(ref, order, x):
    for i in order:
        b = Block(16, 32)
        b.load_state_dict(ref[i])
        x = b(x)
    return x


def test_a_raising_forward_still_releases_its_slot():
    blocks, s, pool, _ = streamer_of(4, (), 1)
    s.attach()
    s.warm()
    with pytest.raises(RuntimeError):
        blocks[0](torch.randn(2, 3))  # wrong width
    assert pool.log[-1][0] == "release"
    s.detach()
