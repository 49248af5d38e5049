"""Float8-stored models computing through upcast_on_use: equal to the bfloat16 model whose
weights are the float8 values, resident, streamed, with merged or dynamic adapters."""

from __future__ import annotations

import copy

import pytest
import torch

import shuttle
from shuttle.errors import ShuttleError
from shuttle.hooks import hooks_of
from shuttle.offload import ModelOffloader
from shuttle.weights import UpcastHook, upcast_on_use
from tests import lowrank_state
from tests.offload.models import RESIDENCY_MODES, TinyDiT

PATHS = ["blocks", "single"]


def fp8_pair(dtype=torch.float8_e4m3fn):
    """(float8 model, its bfloat16 twin): every Linear weight of the blocks stored as float8,
    the twin holding the same values in bfloat16 (biases, norms, embedding: bfloat16 in both)."""
    model = TinyDiT(dtype=torch.bfloat16)
    for b in [*model.blocks, *model.single]:
        for lin in (b.attn, b.up, b.down):
            lin.weight = torch.nn.Parameter(lin.weight.detach().to(dtype), requires_grad=False)
    twin = copy.deepcopy(model)
    for b in [*twin.blocks, *twin.single]:
        for lin in (b.attn, b.up, b.down):
            lin.weight = torch.nn.Parameter(lin.weight.detach().to(torch.bfloat16))
    return model, twin


def tokens():
    return torch.randint(0, 64, (2, 9))


def lora():
    sd = lowrank_state({f"blocks.{i}.{name}": shape for i in range(5)
                        for name, shape in {"attn": (32, 32), "up": (128, 32)}.items()})
    return shuttle.load_lora({k: v.bfloat16() for k, v in sd.items()})


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_forward_equals_the_bf16_twin_and_remove_is_exact(dtype):
    model, twin = fp8_pair(dtype)
    x = tokens()
    params = {n: p for n, p in model.named_parameters()}
    with torch.no_grad():
        want = twin(x)
        handle = upcast_on_use(model)
        assert len(handle.modules) == 3 * 8
        assert torch.equal(model(x), want)
        # The stored float8 parameters are back after each forward, the same objects.
        assert all(p is params[n] for n, p in model.named_parameters())
        assert model.blocks[0].up.weight.dtype == dtype
        handle.remove()
        handle.remove()  # idempotent
    assert all(hooks_of(m) == [] and "forward" not in m.__dict__ for m in model.modules())


def test_gradients_reach_the_activations():
    model, twin = fp8_pair()
    x = twin.embed(tokens()).detach().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    with upcast_on_use(model):
        model.blocks[0](x).sum().backward()
    twin.blocks[0](x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)


@pytest.mark.parametrize("upcast_first", [True, False])
@pytest.mark.parametrize("mode", list(RESIDENCY_MODES))
def test_streamed_float8_matches_the_twin(cpu_copy, mode, upcast_first):
    model, twin = fp8_pair()
    x = tokens()
    with torch.no_grad():
        want = twin(x)
        handle = upcast_on_use(model) if upcast_first else None
        off = ModelOffloader.from_module(model, blocks=PATHS)
        # Only float8 bytes are captured for the block weights.
        host = {n: t for n, t in off.model.named_parameters() if n.endswith("up.weight")}
        assert host and all(t.dtype == torch.float8_e4m3fn for t in host.values())
        handle = handle or upcast_on_use(model)
        with off.use("cpu", RESIDENCY_MODES[mode]) as active:
            for _ in range(2):
                assert torch.equal(active(x), want)
        handle.remove()


def test_layer_mode_binds_before_casting(cpu_copy):
    model, twin = fp8_pair()
    x = tokens()
    with torch.no_grad():
        want = twin(x)
        handle = upcast_on_use(model)
        off = ModelOffloader.from_module(model, layers=True)
        with off.use("cpu", RESIDENCY_MODES["stream2"]) as active:
            chain = hooks_of(active.blocks[0].up)
            assert isinstance(chain[-1], UpcastHook)  # the stream hook stays outermost
            assert torch.equal(active(x), want)
        handle.remove()


@pytest.mark.parametrize("upcast_first", [True, False])
def test_dynamic_adapter_over_float8_matches_the_twin(upcast_first):
    model, twin = fp8_pair()
    x = tokens()
    ad = lora()
    with torch.no_grad():
        with shuttle.apply_lora(twin, [(ad, 0.7)], mode="dynamic", quality="lossless"):
            want = twin(x)
        handle = upcast_on_use(model) if upcast_first else None
        with shuttle.apply_lora(model, [(ad, 0.7)], mode="dynamic", quality="lossless"):
            handle = handle or upcast_on_use(model)
            got = model(x)
            handle.remove()
    assert torch.equal(got, want)


def test_merge_into_float8_then_compute():
    model, _ = fp8_pair()
    ad = lora()
    before = model.blocks[0].up.weight.detach().clone()
    shuttle.merge_lora(model, [(ad, 0.7)], rounding="nearest")
    after = model.blocks[0].up.weight
    assert after.dtype == torch.float8_e4m3fn and not torch.equal(after, before)
    with torch.no_grad(), upcast_on_use(model):
        assert torch.isfinite(model(tokens())).all()


def test_bad_input_raises_and_changes_nothing():
    model, twin = fp8_pair()
    with pytest.raises(ShuttleError, match="not a compute dtype"):
        upcast_on_use(model, torch.int8)
    with pytest.raises(ShuttleError, match="no float8 parameter"):
        upcast_on_use(twin)
    handle = upcast_on_use(model)
    with pytest.raises(ShuttleError, match="hooked already"):
        upcast_on_use(model)
    assert sum(len(hooks_of(m)) for m in model.modules()) == 24
    handle.remove()
    assert all(hooks_of(m) == [] for m in model.modules())


def test_exported():
    assert shuttle.upcast_on_use is upcast_on_use


@pytest.mark.gpu
def test_streamed_float8_on_cuda_matches_the_twin():
    model, twin = fp8_pair()
    x = tokens().cuda()
    with torch.no_grad():
        want = twin.cuda()(x)
        upcast_on_use(model)
        off = ModelOffloader.from_module(model, blocks=PATHS)
        with off.use("cuda", RESIDENCY_MODES["stream2"]) as active:
            for _ in range(2):
                assert torch.equal(active(x), want)


@pytest.mark.parametrize("mode", ["stream2", "whole"])
def test_streamed_merge_into_float8_equals_merge_lora_every_step(cpu_copy, mode):
    # Each fold lands in a fresh copy of the float8 weight: seeded as merge_lora's first merge
    # (stochastic by default for float8), the same bits on every step.
    model, _ = fp8_pair()
    x, ad = tokens(), lora()
    ref = copy.deepcopy(model)
    shuttle.merge_lora(ref, [(ad, 0.7)])
    with torch.no_grad(), upcast_on_use(ref):
        want = ref(x)
    upcast_on_use(model)
    off = ModelOffloader.from_module(model, blocks=PATHS)
    with torch.no_grad(), off.use("cpu", RESIDENCY_MODES[mode], loras=[(ad, 0.7)],
                                  mode="merge") as active:
        for _ in range(3):
            assert torch.equal(active(x), want)
