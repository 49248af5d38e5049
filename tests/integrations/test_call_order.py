"""The order of a handle's calls, and the modules it activates ahead of their calls.

A pipeline calls its modules in one order at every call; while one runs, the handle activates
the modules called after it as far as their weights fit beside it and its reserve, without the
compute stream waiting for their copies (each waits at its own call). The tiny FluxPipeline
runs on the CPU copy path with a meter that reports given activations (tests.integrations.meters);
the GPU side (the copies under the VAE's decode, the waits) is in test_e2e_gpu.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shuttle.integrations import diffusers as shuttle_diffusers
from shuttle.integrations.call_order import CallOrder
from shuttle.offload import ModelOffloader
from tests.integrations.meters import FakeMeter, active, offload, record, sizes
from tests.integrations.models import run_flux

pytest.importorskip("diffusers")

BUDGET = 400_000
ENCODERS = ("text_encoder", "text_encoder_2")  # CLIP, then T5: the next image's first calls


@pytest.fixture(autouse=True)
def _cpu_copy(cpu_copy):
    """Every test here activates on the CPU through the copy path."""


def test_the_order_is_learned_from_the_calls_and_walked_once_around():
    order = CallOrder()
    for name in ["clip", "t5", "dit", "dit", "dit", "vae", "clip"]:  # a step loop calls dit
        order.saw(name)
    assert list(order.after("vae")) == ["clip", "t5", "dit"]  # up to vae itself
    assert list(order.after("dit")) == ["vae", "clip", "t5"]
    assert list(order.after("clip")) == ["t5", "dit", "vae"]
    assert list(order.after("unet")) == []  # never called
    order.saw("vae")  # clip -> vae now: the latest order replaces the one before
    assert list(order.after("clip")) == ["vae"]


@pytest.mark.parametrize("short", [None, "text_encoder_2", "text_encoder"])
def test_the_next_modules_are_activated_under_the_vae_as_far_as_they_fit(
        plain, monkeypatch, short):
    # room: what the budget leaves beside the VAE's weights and reserve, sized so that both
    # encoders fit (short=None), only CLIP (T5's need is one byte over), or neither.
    ref, _, pixels = plain
    whole = {n: sizes(o)[1] for n, o in shuttle_diffusers.offload(
        copy.deepcopy(ref), max_host_bytes=2**22, device="cpu").offloaders.items()}
    room = sum(whole[n] for n in ENCODERS)
    if short is not None:
        room -= 1 + (whole["text_encoder_2"] if short == "text_encoder" else 0)
    ahead = set() if short == "text_encoder" else {"text_encoder"} if short else set(ENCODERS)
    pipe = copy.deepcopy(ref)
    handle = offload(pipe, BUDGET, FakeMeter({"vae": BUDGET - whole["vae"] - room}))
    waits = []  # (module, wait) of each activation; the modules that waited for their copies
    names = {id(o): n for n, o in handle.offloaders.items()}
    activate, ready = ModelOffloader.activate, ModelOffloader.ready
    monkeypatch.setattr(ModelOffloader, "activate", lambda self, *a, **k: waits.append(
        (names[id(self)], k.get("wait", True))) or activate(self, *a, **k))
    readied = []
    monkeypatch.setattr(ModelOffloader, "ready", lambda self: readied.append(
        names[id(self)]) or ready(self))
    decoding = record(pipe.vae.decoder, lambda: active(handle))
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
    handle.remove()


def test_nothing_is_activated_ahead_without_a_budget(plain):
    ref, _, pixels = plain
    pipe = copy.deepcopy(ref)
    handle = shuttle_diffusers.offload(pipe, max_host_bytes=2**22, device="cpu", prefetch=1)
    for _ in range(2):
        assert torch.equal(run_flux(pipe, "pt"), pixels)
        assert active(handle) == {"vae"}  # one module at a time
    handle.remove()
