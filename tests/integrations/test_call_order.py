"""The order of a handle's calls, and the modules it activates ahead of their calls.

A pipeline calls its modules in one order at every call; while one runs, the handle activates
the modules called after it as far as their weights fit beside it and its reserve, without the
compute stream waiting for their copies (each waits at its own call). The tiny FluxPipeline
runs on the CPU copy path with a meter that reports given activations (tests.integrations.models);
the GPU side (the copies under the VAE's decode, the waits) is in test_e2e_gpu.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shuttle.integrations import diffusers as shuttle_diffusers
from shuttle.integrations.call_order import CallOrder
from shuttle.offload import ModelOffloader
from tests.integrations.models import FakeMeter, active, offload, record, run_flux, sizes

pytest.importorskip("diffusers")

BUDGET = 400_000
ENCODERS = ("text_encoder", "text_encoder_2")  # CLIP, then T5: the next image's first calls


@pytest.fixture(autouse=True)
def _cpu_copy(cpu_copy):
    """Every test here activates on the CPU through the copy path."""


def test_the_order_is_learned_from_the_calls_and_walked_once_around():
    order = CallOrder()
    # a one-step warm-up, then a step loop calling dit three times
    turns = [order.saw(n) for n in ["clip", "t5", "dit", "vae", "clip", "t5", "dit", "dit",
                                     "dit", "vae", "clip"]]
    assert turns == [True] * 7 + [False, False, True, True]
    assert list(order.after("vae")) == ["clip", "t5", "dit"]  # up to vae itself
    assert list(order.after("dit")) == ["vae", "clip", "t5"]
    assert list(order.after("clip")) == ["t5", "dit", "vae"]
    assert list(order.after("unet")) == []  # never called
    # once a turn: in two finished turns at least, every one of a single call
    assert [order.once(n) for n in ("clip", "t5", "dit", "vae", "unet")] == [
        True, True, False, True, False]
    first = CallOrder()  # one finished turn of one call: it may have been a warm-up
    for name in ["t5", "dit", "t5"]:
        first.saw(name)
    assert not first.once("t5") and not first.once("dit")
    order.saw("vae")  # clip -> vae now: the latest order replaces the one before
    assert list(order.after("clip")) == ["vae"]


def footprints(ref) -> dict[str, tuple[int, int]]:
    """Each module's (floor, everything resident) device bytes, streamed as under a budget."""
    handle = offload(copy.deepcopy(ref), BUDGET, FakeMeter())
    return {n: sizes(o) for n, o in handle.offloaders.items()}


def spy(handle, monkeypatch) -> tuple[list, list]:
    """Lists that get (module, wait) at each activation and the module at each ready()."""
    names = {id(o): n for n, o in handle.offloaders.items()}
    waits, readied = [], []
    activate, ready = ModelOffloader.activate, ModelOffloader.ready
    monkeypatch.setattr(ModelOffloader, "activate", lambda self, *a, **k: waits.append(
        (names[id(self)], k.get("wait", True))) or activate(self, *a, **k))
    monkeypatch.setattr(ModelOffloader, "ready", lambda self: readied.append(
        names[id(self)]) or ready(self))
    return waits, readied


@pytest.mark.parametrize("fit", ["whole", "fewer", "none"])
def test_the_next_modules_are_activated_under_the_vae_as_far_as_they_fit(
        plain, monkeypatch, fit):
    # room: what the budget leaves beside the VAE's weights and reserve, sized so that both
    # encoders fit whole, T5 only with a block fewer resident (a byte short: T5 is called once
    # a turn, so it is activated with a smaller plan), or not even CLIP's floor.
    ref, _, pixels = plain
    size = footprints(ref)
    room = {"whole": size["text_encoder"][1] + size["text_encoder_2"][1],
            "fewer": size["text_encoder"][1] + size["text_encoder_2"][1] - 1,
            "none": size["text_encoder"][0] - 1}[fit]
    ahead = set() if fit == "none" else set(ENCODERS)
    pipe = copy.deepcopy(ref)
    handle = offload(pipe, BUDGET, FakeMeter({"vae": BUDGET - size["vae"][1] - room}))
    waits, readied = spy(handle, monkeypatch)
    decoding = record(pipe.vae.decoder, lambda: active(handle))
    t5 = record(pipe.text_encoder_2.encoder.block[0],
                lambda: handle.offloaders["text_encoder_2"].plan.device_bytes)
    assert torch.equal(run_flux(pipe, "pt"), pixels)  # learns the order and the activations
    assert decoding[-1] == {"vae"} and all(w for _, w in waits)  # nothing known: nothing ahead
    waits.clear()
    assert torch.equal(run_flux(pipe, "pt"), pixels)
    assert decoding[-1] == {"vae"} | ahead  # activated before the decode ran
    assert ahead <= {n for n, w in waits if not w}  # without waiting for their copies
    assert active(handle) == {"vae"} | ahead
    waits.clear()
    readied.clear()
    assert torch.equal(run_flux(pipe, "pt"), pixels)  # starts on the modules activated ahead
    assert ahead <= set(readied)  # each waited for its copies at its own call
    assert not ahead & {n for n, w in waits if w}  # not activated again at its call
    whole = size["text_encoder_2"][1]
    assert (t5[-1] == whole) if fit == "whole" else (t5[-1] < whole) if fit == "fewer" else True
    handle.remove()


def test_a_module_called_in_a_loop_is_activated_ahead_only_with_its_own_plan(
        plain, monkeypatch):
    # Room for the transformer's floor beside the others, not for its plan: with fewer blocks
    # resident its every step would copy more, so it waits for its call.
    ref, latents, pixels = plain
    size = footprints(ref)
    budget = sum(size[n][1] for n in ("vae", *ENCODERS)) + size["transformer"][0]
    pipe = copy.deepcopy(ref)
    handle = offload(pipe, budget, FakeMeter())
    waits, _ = spy(handle, monkeypatch)
    for _ in range(3):
        assert torch.equal(run_flux(pipe, "pt"), pixels)
    assert {n for n, w in waits if not w} == set(ENCODERS)
    assert torch.equal(run_flux(pipe), latents)
    handle.remove()


def test_an_activation_ahead_that_fails_leaves_the_call_and_the_module_as_they_were(
        plain, monkeypatch, caplog):
    # A device OOM while activating T5 ahead (under the VAE's decode): the decode goes on, T5
    # is rolled back and activated at its own call as without the guess.
    ref, _, pixels = plain
    pipe = copy.deepcopy(ref)
    handle = offload(pipe, BUDGET, FakeMeter())
    activate = ModelOffloader.activate
    t5 = handle.offloaders["text_encoder_2"]

    def failing(self, *args, **kwargs):
        if self is t5 and not kwargs.get("wait", True):
            raise torch.OutOfMemoryError("CUDA out of memory (planted)")
        return activate(self, *args, **kwargs)

    monkeypatch.setattr(ModelOffloader, "activate", failing)
    for _ in range(3):
        assert torch.equal(run_flux(pipe, "pt"), pixels)
    assert "activating ahead under vae's call failed" in caplog.text
    assert active(handle) == {"vae", "text_encoder"}  # CLIP ahead; T5 not, and not half-placed
    assert not t5.active
    handle.remove()


def test_nothing_is_activated_ahead_without_a_budget(plain):
    ref, _, pixels = plain
    pipe = copy.deepcopy(ref)
    handle = shuttle_diffusers.offload(pipe, max_host_bytes=2**22, device="cpu", prefetch=1)
    for _ in range(2):
        assert torch.equal(run_flux(pipe, "pt"), pixels)
        assert active(handle) == {"vae"}  # one module at a time
    handle.remove()
