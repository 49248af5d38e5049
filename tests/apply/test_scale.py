"""``shuttle.lora_scale`` belongs to the thread or task that set it; compiled code reads the
shared tensor and follows changes without recompiling (tests/apply/test_dynamic.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from torch import nn

import shuttle
from shuttle.apply.scale import request_scale, request_scale_value


def _model_and_outputs(quality: str):
    """A dynamic Linear and its outputs at request scales 1 and 0 (the base)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 24))
    g = torch.Generator().manual_seed(1)
    sd = {"0.lora_A.weight": torch.randn(4, 16, generator=g),
          "0.lora_B.weight": torch.randn(24, 4, generator=g)}
    x = torch.randn(3, 16, generator=g)
    base = m(x).detach()
    handle = shuttle.attach_lora(m, [(sd, 1.0)], quality=quality)
    full = m(x).detach()
    assert not torch.allclose(full, base)
    return m, handle, x, base, full


@pytest.mark.parametrize("quality", ["exact", "lossless"])
def test_another_threads_scale_does_not_reach_this_thread(quality):
    m, handle, x, base, full = _model_and_outputs(quality)
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def request():  # a request at scale 0 that stays open while the other thread runs
        with shuttle.lora_scale(0.0):
            inside.set()
            release.wait(10)
            seen["scaled"] = m(x).detach()

    t = threading.Thread(target=request)
    t.start()
    assert inside.wait(10)
    try:
        seen["mine"] = m(x).detach()
        assert request_scale_value() == 1.0
    finally:
        release.set()
        t.join(10)
    assert torch.equal(seen["mine"], full)
    torch.testing.assert_close(seen["scaled"], base)
    handle.detach()


def test_asyncio_tasks_keep_their_own_scale():
    m, handle, x, base, full = _model_and_outputs("lossless")
    half = None
    with shuttle.lora_scale(0.5):
        half = m(x).detach()

    async def request(scale: float, wait_for: asyncio.Event, then: asyncio.Event):
        with shuttle.lora_scale(scale):
            await wait_for.wait()
            out = m(x).detach()
            then.set()
            await asyncio.sleep(0)
            return out

    async def main():
        # The 0.5 task enters first and runs its forward while the 1.0 task's scope, set
        # later, is open; then the 1.0 task runs its forward.
        opened, computed = asyncio.Event(), asyncio.Event()

        async def second():
            with shuttle.lora_scale(1.0):
                opened.set()
                await computed.wait()
                return m(x).detach()

        return await asyncio.gather(request(0.5, opened, computed), second())

    got_half, got_full = asyncio.run(main())
    assert torch.equal(got_half, half) and torch.equal(got_full, full)
    handle.detach()


def test_eager_tensors_are_per_value_and_never_written():
    dev = torch.device("cpu")
    one = request_scale(dev)
    with shuttle.lora_scale(0.25):
        quarter = request_scale(dev)
        assert float(quarter) == 0.25
    assert float(one) == 1.0 and float(quarter) == 0.25  # a queued read keeps its value
    assert request_scale(dev) is one
