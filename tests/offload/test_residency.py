"""Residency policies: a custom one is one class, its plan is checked before anything moves."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shuttle.errors import OffloadError
from shuttle.offload import StreamConfig
from shuttle.offload.residency import ResidencyPlan, SpreadResidency, plan_cost
from tests.offload.test_offloader import device_bytes_held, pair, tokens


class KeepLast:
    """Keep the last ``k`` blocks of every group (say, the ones a profile found slowest to
    copy), stream the rest through one slot."""

    def __init__(self, k: int):
        self.k = k

    def plan(self, storage, config):
        resident = {g: tuple(range(max(len(us) - self.k, 0), len(us)))
                    for g, us in storage.groups.items()}
        ring = {g: 1 if len(resident[g]) < len(us) else 0 for g, us in storage.groups.items()}
        return ResidencyPlan(resident, ring, 0, plan_cost(storage, resident, ring))


def test_a_custom_policy_decides_what_stays(cpu_copy):
    ref, off = pair()
    x = tokens()
    with torch.no_grad():
        want = ref(x)
        with off.use("cpu", StreamConfig(policy=KeepLast(2))) as model:
            assert off.plan.resident == {"blocks": (3, 4), "single": (1, 2)}
            assert device_bytes_held(off) == off.plan.device_bytes
            for _ in range(3):
                assert torch.equal(model(x), want)
        assert torch.equal(off.model(x), want)


def test_the_default_is_the_spread_policy(cpu_copy):
    _, off = pair()
    for config in (StreamConfig(resident=2), StreamConfig(resident=2, policy=SpreadResidency())):
        with off.use("cpu", config):
            assert off.plan.resident == {"blocks": (1, 3), "single": (0, 2)}


class Broken(KeepLast):
    def __init__(self, change):
        super().__init__(2)
        self.change = change

    def plan(self, storage, config):
        return self.change(super().plan(storage, config))


@pytest.mark.parametrize(("change", "why"), [
    (lambda p: dataclasses.replace(p, resident={**p.resident, "blocks": (7,)}),
     "resident positions"),
    (lambda p: dataclasses.replace(p, ring={**p.ring, "blocks": 0}), "no ring slot"),
    (lambda p: dataclasses.replace(p, device_bytes=p.device_bytes - 1), "device bytes"),
    (lambda p: dataclasses.replace(p, resident={"blocks": p.resident["blocks"]}), "covers"),
])
def test_a_bad_plan_is_refused_naming_the_policy(cpu_copy, change, why):
    ref, off = pair()
    x = tokens()
    with pytest.raises(OffloadError, match=f"Broken: .*{why}"), \
            off.use("cpu", StreamConfig(policy=Broken(change))):
        pass
    with torch.no_grad():
        assert torch.equal(off.model(x), ref(x))


def test_a_plan_over_the_budget_is_refused(cpu_copy):
    _, off = pair()
    with pytest.raises(OffloadError, match="over vram_budget"), \
            off.use("cpu", StreamConfig(policy=KeepLast(5), vram_budget=1)):
        pass


def test_a_policy_needs_a_plan_method():
    with pytest.raises(OffloadError, match="plan\\(storage, config\\)"):
        StreamConfig(policy=object())


def test_a_plan_chosen_once_is_used_as_given(cpu_copy):
    ref, off = pair()
    x = tokens()
    plan = off.plan_for(StreamConfig(prefetch=1, policy=KeepLast(2)))
    with torch.no_grad():
        want = ref(x)
        with off.use("cpu", plan=plan) as model:
            assert off.plan is plan
            assert device_bytes_held(off) == plan.device_bytes
            assert torch.equal(model(x), want)
        with off.use("cpu", StreamConfig(compile=False), plan=plan):
            assert off.plan is plan  # a stream without a residency of its own may come along


@pytest.mark.parametrize("stream", [StreamConfig(vram_budget=10**9), StreamConfig(resident=1),
                                    StreamConfig(policy=KeepLast(1))])
def test_a_plan_with_a_stream_that_plans_too_is_refused(cpu_copy, stream):
    _, off = pair()
    plan = off.plan_for(StreamConfig(resident=1))
    with pytest.raises(OffloadError, match="plan was chosen"), off.use("cpu", stream,
                                                                      plan=plan):
        pass
    assert not off.active


def test_a_plan_made_for_another_model_is_refused(cpu_copy):
    ref, off = pair()
    plan = off.plan_for(StreamConfig(resident=1))
    other = dataclasses.replace(plan, resident={"blocks": (9,), "single": ()})
    with pytest.raises(OffloadError, match="resident positions"), off.use("cpu", plan=other):
        pass
    assert not off.active
    x = tokens()
    with torch.no_grad():
        assert torch.equal(off.model(x), ref(x))
