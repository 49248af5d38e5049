"""Layer mode: models without block lists, each layer's weights streamed just in time."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import BudgetTooSmallError, CheckpointRequiredError, OffloadError
from shuttle.hooks import hooks_of
from shuttle.offload import ModelOffloader, StreamConfig
from tests import lowrank_state
from tests.offload.models import TinyDiT

LAYER_MODES = {
    "whole": None,
    "stream0": StreamConfig(prefetch=0),
    "stream2": StreamConfig(prefetch=2),
    "resident": StreamConfig(prefetch=1, resident=3),
    "budget": StreamConfig(prefetch=1, vram_budget=40_000),
}



class ConvNet(nn.Module):
    """No block list: convs, a norm with running stats (buffers), linears called out of order."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc2 = nn.Linear(64, 10)  # registered before fc1, called after it
        self.fc1 = nn.Linear(8 * 4 * 4, 64)
        self.scale = nn.Parameter(torch.tensor(1.5))  # a parameter of a non-leaf: resident

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        x = nn.functional.adaptive_avg_pool2d(torch.relu(self.conv2(x)), 4)
        return self.fc2(torch.relu(self.fc1(x.flatten(1)))) * self.scale


def pair(model=None, **kw):
    model = ConvNet().eval() if model is None else model
    ref = copy.deepcopy(model)
    return ref, ModelOffloader.from_module(model, layers=kw.pop("layers", True), **kw)


def images():
    return torch.randn(2, 3, 8, 8)


def in_pool(t, pool):
    return any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() for b in pool.buffers)


@pytest.mark.parametrize("host", ["pinned", "adopt"])
@pytest.mark.parametrize("mode", list(LAYER_MODES))
def test_every_mode_matches_the_resident_model(cpu_copy, mode, host):
    ref, off = pair(host=host)
    assert list(off.layers) == ["conv1", "bn", "conv2", "fc2", "fc1"]
    x = images()
    with torch.no_grad():
        want = ref(x)
        with off.use("cpu", LAYER_MODES[mode]) as model:
            for _ in range(3):  # steady state, the ring wrapping across steps
                assert torch.equal(model(x), want)
        assert torch.equal(off.model(x), want)


def test_streamed_layers_compute_from_the_ring_and_the_rest_stays_resident(cpu_copy):
    _, off = pair()
    with off.use("cpu", StreamConfig(prefetch=1)) as model, torch.no_grad():
        ring = off.layer_streamer.pool
        rest = off._active.pools[0]
        seen = []
        # A forward hook runs after the layer's forward, while its weights are still bound.
        handle = model.fc1.register_forward_hook(
            lambda m, a, o: seen.append(in_pool(m.weight, ring) and in_pool(m.bias, ring)))
        model(images())
        handle.remove()
        assert seen == [True]
        # Buffers of a layer and parameters outside the layers are in the resident rest.
        assert in_pool(model.bn.running_mean, rest) and in_pool(model.scale, rest)
        assert not in_pool(model.bn.running_mean, ring)


def test_a_fixed_pool_serves_every_step_and_the_order_is_learned(cpu_copy):
    _, off = pair()
    sizes = [u.layout.nbytes for u in off.storage.layers]
    with off.use("cpu", StreamConfig(prefetch=2)) as model, torch.no_grad():
        s = off.layer_streamer
        assert s.pool.n_slots == 3 and s.pool.layout.nbytes == max(sizes)
        buffers = list(s.pool.buffers)
        x = images()
        # fc2 is registered before fc1: the first step misses it, and the wrap (fc2 -> conv1)
        # is learned at the start of the second.
        model(x)
        model(x)
        assert 1 <= s.misses <= 2
        loads, misses = s.loads, s.misses
        for _ in range(3):
            model(x)
        assert s.misses == misses  # learned: every later load is a prefetch
        assert s.loads - loads == 3 * 5  # each streamed layer loaded once per step
        assert all(a is b for a, b in zip(s.pool.buffers, buffers, strict=True))
        assert len(s.pool._mixed) <= 3 * 5  # one set of views per (slot, layer), reused


def test_budget_chooses_resident_layers(cpu_copy):
    _, off = pair()
    rest = off.storage.rest.layout.nbytes
    sizes = [u.layout.nbytes for u in off.storage.layers]
    minimum = rest + max(sizes)
    with pytest.raises(BudgetTooSmallError, match=f"at least {minimum} bytes"):
        off.activate("cpu", StreamConfig(vram_budget=minimum - 1))
    kept = []
    for budget in [minimum, minimum + 2 * max(sizes), rest + sum(sizes)]:
        with off.use("cpu", StreamConfig(prefetch=1, vram_budget=budget)):
            assert off.plan.device_bytes <= budget
            kept.append(len(off.plan.layers))
    assert kept[0] == 0 and kept == sorted(kept) and kept[-1] == 5
    with off.use("cpu", StreamConfig(vram_budget=rest + sum(sizes))):
        assert off.layer_streamer is None  # everything fits: nothing streams


def test_tied_and_non_leaf_parameters_stay_with_the_rest(cpu_copy):
    ref, off = pair(TinyDiT(), layers=(nn.Linear, nn.Embedding))
    assert "head" not in off.layers and "embed" not in off.layers  # tied to each other
    assert "blocks.0.up" in off.layers and "blocks.0.norm" not in off.layers
    x = torch.randint(0, 64, (2, 9))
    with off.use("cpu", StreamConfig(prefetch=2)) as model, torch.no_grad():
        assert model.head.weight is model.embed.weight
        assert torch.equal(model(x), ref(x))


def test_deactivate_restores_forward_exactly(cpu_copy):
    _, off = pair()
    model = off.model
    sig = inspect.signature(model.fc1.forward)
    host_ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with off.use("cpu", StreamConfig(prefetch=1)), torch.no_grad():
        assert hooks_of(model.fc1) and "forward" in model.fc1.__dict__
        model(images())
    assert all(hooks_of(m) == [] and "forward" not in m.__dict__ for m in model.modules())
    assert inspect.signature(model.fc1.forward) == sig
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == host_ptrs


def lora_for_convnet():
    g = torch.Generator().manual_seed(5)
    low = lowrank_state({"fc1": (64, 128), "fc2": (10, 64)}, generator=g)
    dense = {"conv2.diff": torch.randn(8, 8, 3, 3, generator=g) * 0.01}
    return [(shuttle.load_lora(low), 0.8), (shuttle.load_lora(dense), 0.5)]


@pytest.mark.parametrize("mode", ["stream0", "stream2", "resident"])
def test_lora_merge_in_layer_mode_is_bit_identical_to_merge_lora(cpu_copy, mode):
    ref, off = pair()
    loras = lora_for_convnet()
    shuttle.merge_lora(ref, loras)
    x = images()
    with torch.no_grad(), off.use("cpu", LAYER_MODES[mode], loras=loras) as model:
        for _ in range(2):  # a reloaded layer is merged again, from the pristine host copy
            assert torch.equal(model(x), ref(x))
    with torch.no_grad():
        assert not torch.equal(off.model(x), ref(x))  # host copy untouched


@pytest.mark.parametrize("mode", ["stream0", "stream2"])
def test_lora_dynamic_in_layer_mode_equals_attach_lora(cpu_copy, mode):
    ref, off = pair()
    loras = lora_for_convnet()
    x = images()
    with torch.no_grad(), shuttle.apply_lora(ref, loras, mode="dynamic", quality="exact"):
        want = ref(x)
    with torch.no_grad(), off.use("cpu", LAYER_MODES[mode], loras=loras, mode="dynamic",
                                  quality="exact") as model:
        # The stream hook is outermost: the LoRA hook sees the layer's weights in its slot.
        assert type(hooks_of(model.fc1)[0]).__name__ == "SlotHook"
        for _ in range(2):
            torch.testing.assert_close(model(x), want, rtol=0, atol=1e-6)
    assert all(hooks_of(m) == [] for m in off.model.modules())


def test_a_backward_through_a_refilled_layer_raises(cpu_copy):
    _, off = pair()
    with off.use("cpu", StreamConfig(prefetch=0)) as model:
        y = model(images())  # grad mode: the forward itself works
        with pytest.raises(CheckpointRequiredError, match="refilled"):
            y.sum().backward()


def test_resident_layers_train(cpu_copy):
    ref, off = pair(ConvNet().train())
    x = images()
    ref(x).sum().backward()
    with off.use("cpu", None) as model:  # whole: every layer resident
        model(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bad_layer_options_raise():
    with pytest.raises(OffloadError, match="nn.Module classes"):
        ModelOffloader.from_module(ConvNet(), layers=("Linear",))
    with pytest.raises(OffloadError, match="selects no module"):
        ModelOffloader.from_module(ConvNet(), layers=(nn.Embedding,))
    _, off = pair()
    with pytest.raises(shuttle.errors.StreamModeError, match="blocks="):
        off.activate("cpu", StreamConfig(compile="eager"))
    assert not off.active


@pytest.mark.gpu
def test_layer_mode_on_cuda_matches_and_reuses_its_slots():
    ref, off = pair()
    ref = ref.cuda()
    x = images().cuda()
    with torch.no_grad(), off.use("cuda", StreamConfig(prefetch=2)) as model:
        buffers = [b.data_ptr() for b in off.layer_streamer.pool.buffers]
        for _ in range(3):
            assert torch.equal(model(x), ref(x))
        assert [b.data_ptr() for b in off.layer_streamer.pool.buffers] == buffers
