"""Block lists whose blocks differ: one ring sized by the largest, resident blocks at their own
size, costs counted per block, and the floor named when the budget is below it.

TinyT5's first block holds the relative-position table (as T5's does); TinyUNet's stages change
width. Both stream as one group per list and give the resident model's outputs bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from shuttle.errors import BudgetTooSmallError, OffloadError
from shuttle.offload import (
    ModelOffloader,
    RingOnlyResidency,
    StreamConfig,
    floor_bytes,
    plan_cost,
)
from tests.offload.models import RESIDENCY_MODES, TinyT5, TinyUNet
from tests.offload.test_offloader import device_bytes_held, pointers_into


def t5(host="pinned"):
    model = TinyT5()
    return copy.deepcopy(model), ModelOffloader.from_module(model, blocks="block", host=host)


def unet():
    model = TinyUNet()
    return copy.deepcopy(model), ModelOffloader.from_module(model, blocks=["down", "up"])


def sizes(off, group):
    return [u.layout.nbytes for u in off.storage.groups[group]]


@pytest.mark.parametrize("host", ["pinned", "adopt"])
@pytest.mark.parametrize("mode", list(RESIDENCY_MODES))
def test_a_t5_like_list_streams_whole_in_every_mode(cpu_copy, mode, host):
    ref, off = t5(host)
    x = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        want = ref(x)
        with off.use("cpu", RESIDENCY_MODES[mode]) as model:
            seen, handle = pointers_into(off, model.block[0].rel)
            for _ in range(3):
                assert torch.equal(model(x), want)
            handle.remove()
            assert device_bytes_held(off) == off.plan.device_bytes
        assert seen and all(seen)  # the first block's table came through a device slot
        assert torch.equal(off.model(x), want)


@pytest.mark.parametrize("mode", list(RESIDENCY_MODES))
def test_unet_like_stages_of_different_widths_stream_as_groups(cpu_copy, mode):
    ref, off = unet()
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = ref(x)
        with off.use("cpu", RESIDENCY_MODES[mode]) as model:
            for _ in range(3):
                assert torch.equal(model(x), want)
            assert device_bytes_held(off) == off.plan.device_bytes


def test_the_ring_is_sized_by_the_largest_streamed_block(cpu_copy):
    _, off = t5()
    block = sizes(off, "block")
    assert block[0] > block[1] == block[4]  # the table makes the first block larger
    with off.use("cpu", StreamConfig(prefetch=1)):
        ring = off.streamers["block"].pool
        assert ring.n_slots == 2 and ring.layout.nbytes == block[0]
        assert device_bytes_held(off) == off.storage.rest.layout.nbytes + 2 * block[0]
    # With the first block resident, the ring's slots shrink to the others' size and the
    # resident block takes exactly its own.
    with off.use("cpu", StreamConfig(prefetch=1, policy=KeepFirst())):
        assert off.streamers["block"].pool.layout.nbytes == block[1]
        assert device_bytes_held(off) == (off.storage.rest.layout.nbytes + block[0]
                                          + 2 * block[1])
        assert device_bytes_held(off) == off.plan.device_bytes


class KeepFirst:
    """Keep block 0 of the ``block`` group; stream the rest through two slots."""

    def plan(self, storage, config):
        from shuttle.offload import ResidencyPlan

        resident, ring = {"block": (0,)}, {"block": 2}
        return ResidencyPlan(resident, ring, 1, plan_cost(storage, resident, ring))


def test_plan_cost_counts_each_block_at_its_own_size():
    _, off = unet()
    down, up = sizes(off, "down"), sizes(off, "up")
    rest = off.storage.rest.layout.nbytes
    assert len(set(down)) == 3 and len(set(up)) == 3
    assert plan_cost(off.storage, {"down": (), "up": ()}, {"down": 1, "up": 1}) == (
        rest + max(down) + max(up))
    big = down.index(max(down))
    assert plan_cost(off.storage, {"down": (big,), "up": ()}, {"down": 2, "up": 1}) == (
        rest + down[big] + 2 * max(d for i, d in enumerate(down) if i != big) + max(up))
    everything = {"down": (0, 1, 2), "up": (0, 1, 2)}
    assert plan_cost(off.storage, everything, {"down": 0, "up": 0}) == (
        rest + sum(down) + sum(up))


def test_the_floor_is_the_smallest_budget_that_runs(cpu_copy):
    ref, off = unet()
    floor = floor_bytes(off.storage)
    assert floor == (off.storage.rest.layout.nbytes + max(sizes(off, "down"))
                     + max(sizes(off, "up")))
    with pytest.raises(BudgetTooSmallError, match=f"floor of {floor} bytes.*at least {floor}"):
        off.plan_for(StreamConfig(vram_budget=floor - 1))
    x = torch.randn(3, 8)
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=2, vram_budget=floor)) as m:
        assert off.plan.prefetch == 0 and device_bytes_held(off) <= floor
        assert torch.equal(m(x), ref(x))


def test_activation_bytes_come_out_of_the_budget_and_are_named_in_the_floor():
    _, off = t5()
    total = off.storage.weight_bytes * 2
    for reserve in (0, 10_000, 40_000):
        plan = off.plan_for(StreamConfig(prefetch=1, vram_budget=total,
                                         activation_bytes=reserve))
        same = off.plan_for(StreamConfig(prefetch=1, vram_budget=total - reserve))
        assert plan == same and plan.device_bytes <= total - reserve
    block = sizes(off, "block")[1]
    budget = off.storage.rest.layout.nbytes + 6 * block
    counts = [len(off.plan_for(StreamConfig(prefetch=0, vram_budget=budget,
                                            activation_bytes=a)).resident["block"])
              for a in (0, block, 2 * block)]
    assert counts == [5, 3, 2]  # each reserve takes the room of resident blocks
    floor = floor_bytes(off.storage)
    with pytest.raises(BudgetTooSmallError) as e:
        off.plan_for(StreamConfig(vram_budget=floor + 99, activation_bytes=100))
    assert f"floor of {floor + 100} bytes" in str(e.value)
    assert "100 bytes kept for activations" in str(e.value)
    with pytest.raises(OffloadError, match="give vram_budget too"):
        StreamConfig(activation_bytes=1)


def test_ring_only_keeps_nothing_resident_and_fits_the_deepest_prefetch(cpu_copy):
    ref, off = t5()
    block = sizes(off, "block")
    rest = off.storage.rest.layout.nbytes
    budget = rest + 2 * block[0] + block[0] // 2  # two slots fit, three do not
    plan = off.plan_for(StreamConfig(prefetch=4, vram_budget=budget, policy=RingOnlyResidency()))
    assert plan.resident == {"block": ()} and plan.ring == {"block": 2} and plan.prefetch == 1
    roomy = StreamConfig(prefetch=1, vram_budget=10**6)
    assert off.plan_for(roomy).resident["block"]  # the default policy keeps blocks resident
    plan_roomy = off.plan_for(dataclasses.replace(roomy, policy=RingOnlyResidency()))
    assert plan_roomy.resident == {"block": ()} and plan_roomy.ring == {"block": 2}
    x = torch.randint(0, 64, (2, 7))
    with torch.no_grad(), off.use("cpu", plan=plan) as m:
        assert torch.equal(m(x), ref(x))


@pytest.mark.parametrize("mode", ["stream0", "stream2", "resident"])
def test_training_through_a_list_whose_blocks_differ(cpu_copy, mode):
    from torch.utils.checkpoint import checkpoint

    ref, off = t5()
    x = torch.randint(0, 64, (2, 7))

    def loss(model):
        h, bias = model.embed(x), None
        for b in model.block:  # each block recomputed in the backward, reloaded into the ring
            h, bias = checkpoint(b, h, bias, use_reentrant=False)
        return model.norm(h).square().mean()

    loss(ref).backward()
    with off.use("cpu", RESIDENCY_MODES[mode]) as model:
        loss(model).backward()
        got = dict(model.named_parameters())
        for n, q in ref.named_parameters():
            torch.testing.assert_close(got[n].grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
        assert got["block.0.rel.weight"].grad.abs().sum() > 0
