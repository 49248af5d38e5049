"""``shuttle.scaled_stream``: a generator's ``lora_scale`` holds in its own steps only, whoever
steps it and whenever it is dropped; sends, throws and returns pass through."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading

import pytest
import torch
from torch import nn

import shuttle
from shuttle.apply.scale import request_scale_value, shared_request_scale
from shuttle.errors import InvalidOptionError
from tests import lowrank_state


@pytest.fixture
def adapted():
    """A Linear with one dynamic adapter, its input, and its outputs at request scales."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 24))
    handle = shuttle.attach_lora(m, [(lowrank_state({"0": (24, 16)}, scale=0.5), 1.0)])
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    at = {}
    for s in (0.0, 0.5, 1.0, 2.0):
        with torch.no_grad(), shuttle.lora_scale(s):
            at[s] = m(x)
    assert len({tuple(t.flatten().tolist()) for t in at.values()}) == 4
    yield lambda: m(x).detach(), at
    handle.detach()


def _stream(forward, scale, n=3):
    with shuttle.lora_scale(scale):
        for _ in range(n):
            yield forward()


def _shared() -> float:
    """The scale compiled code and CUDA graphs read (process-wide)."""
    return float(shared_request_scale(torch.device("cpu")))


def test_a_paused_stream_keeps_its_scale_to_itself(adapted):
    forward, at = adapted
    stream = shuttle.scaled_stream(_stream(forward, 0.0))
    assert torch.equal(next(stream), at[0.0])
    assert torch.equal(forward(), at[1.0])  # paused inside the stream's scope
    with shuttle.lora_scale(0.5):  # the caller's own scope does not reach the stream either
        assert torch.equal(next(stream), at[0.0])
        assert torch.equal(forward(), at[0.5])
    assert torch.equal(next(stream), at[0.0])
    with pytest.raises(StopIteration):
        next(stream)
    assert torch.equal(forward(), at[1.0]) and _shared() == 1.0


def test_interleaved_streams_each_keep_their_scale_as_either_ends(adapted):
    # Unwrapped, the first to end would reset the shared context's scale under the other.
    forward, at = adapted
    short = shuttle.scaled_stream(_stream(forward, 0.5, n=1))
    long = shuttle.scaled_stream(_stream(forward, 2.0))
    assert torch.equal(next(short), at[0.5])
    assert torch.equal(next(long), at[2.0])
    assert list(short) == []  # ends: its scope closes while long's is open
    assert torch.equal(forward(), at[1.0])
    assert [torch.equal(y, at[2.0]) for y in long] == [True, True]
    assert torch.equal(forward(), at[1.0]) and _shared() == 1.0


def test_a_stream_stepped_from_other_threads_keeps_its_scale(adapted):
    """A thread pool iterating a response: every step (and the close) in a new thread, whose
    context holds no scale."""
    forward, at = adapted
    stream = shuttle.scaled_stream(_stream(forward, 0.5))

    def in_thread(step):
        out = []
        t = threading.Thread(target=lambda: out.append(step()))
        t.start()
        t.join(30)
        assert out, "the step raised in its thread"
        return out[0]

    assert torch.equal(in_thread(lambda: next(stream)), at[0.5])
    assert torch.equal(in_thread(lambda: next(stream)), at[0.5])
    in_thread(stream.close)  # left mid-stream: its scope closes in the stream's context
    assert torch.equal(forward(), at[1.0]) and _shared() == 1.0


def test_a_dropped_stream_closes_its_scope_where_it_opened(adapted, monkeypatch):
    forward, at = adapted
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    closed = []

    def stream():
        try:
            yield from _stream(forward, 0.0)
        finally:
            closed.append(request_scale_value())

    for y in shuttle.scaled_stream(stream()):
        assert torch.equal(y, at[0.0])
        break  # the wrapper is dropped mid-stream: garbage collection closes it
    gc.collect()
    assert closed == [1.0] and unraisable == []
    assert torch.equal(forward(), at[1.0]) and _shared() == 1.0

    kept = shuttle.scaled_stream(stream())
    next(kept)
    kept.close()  # an explicit close from the caller's context
    assert closed == [1.0, 1.0] and _shared() == 1.0


def test_send_throw_and_return_pass_through():
    def echo():
        total = 0.0
        with shuttle.lora_scale(0.25):
            while True:
                try:
                    got = yield request_scale_value()
                except KeyError as e:
                    got = yield f"caught {e.args[0]}"
                if got is None:
                    return total
                total += got * request_scale_value()

    stream = shuttle.scaled_stream(echo())
    assert next(stream) == 0.25 and request_scale_value() == 1.0
    assert stream.send(4.0) == 0.25
    assert stream.throw(KeyError("k")) == "caught k"
    assert stream.send(8.0) == 0.25
    with pytest.raises(StopIteration) as stop:
        stream.send(None)
    assert stop.value.value == 3.0
    raised = shuttle.scaled_stream(echo())
    next(raised)
    with pytest.raises(ValueError, match="bad"):
        raised.throw(ValueError("bad"))


def test_as_a_decorator_each_call_starts_from_its_callers_scale():
    @shuttle.scaled_stream
    def scales(n):
        """Doc."""
        for _ in range(n):
            yield request_scale_value()
            with shuttle.lora_scale(request_scale_value() * 2):
                yield request_scale_value()

    assert scales.__name__ == "scales" and scales.__doc__ == "Doc."
    with shuttle.lora_scale(0.5):
        stream = scales(2)  # the context is copied here
    assert list(stream) == [0.5, 1.0, 0.5, 1.0]
    assert list(scales(1)) == [1.0, 2.0]


def test_an_async_stream_keeps_its_scale_to_itself(adapted):
    forward, at = adapted

    closed, loop_errors = [], []

    async def stream():
        try:
            with shuttle.lora_scale(0.0):
                for _ in range(3):
                    await asyncio.sleep(0)  # a step that waits on the loop
                    yield forward()
        finally:
            closed.append(request_scale_value())

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _, c: loop_errors.append(c))
        got, other = [], []
        gen = shuttle.scaled_stream(stream())
        paused = asyncio.Event()

        async def another_request():  # runs while the stream is paused in its scope
            await paused.wait()
            other.append(forward())

        task = asyncio.create_task(another_request())
        got.append(await anext(gen))
        paused.set()
        await task
        other.append(forward())  # the caller itself
        got.append(await anext(gen))
        await gen.aclose()  # left mid-stream: the scope closes in the stream's context
        other.append(forward())
        dropped = shuttle.scaled_stream(stream())
        got.append(await anext(dropped))
        del dropped  # the loop's finalizer closes it: in the stream's context too
        gc.collect()
        for _ in range(4):
            await asyncio.sleep(0)
        other.append(forward())
        return got, other

    got, other = asyncio.run(main())
    assert all(torch.equal(y, at[0.0]) for y in got) and len(got) == 3
    assert all(torch.equal(y, at[1.0]) for y in other) and len(other) == 4
    assert closed == [1.0, 1.0] and loop_errors == [] and _shared() == 1.0


def test_an_async_stream_passes_sends_throws_and_cancellation_through():
    async def echo():
        with shuttle.lora_scale(0.25):
            while True:
                try:
                    got = yield request_scale_value()
                except KeyError:
                    got = yield "caught"
                await asyncio.sleep(0)
                if got == "wait":
                    await asyncio.sleep(3600)

    async def main():
        gen = shuttle.scaled_stream(echo())
        seen = [await gen.asend(None), await gen.asend(1), await gen.athrow(KeyError("k")),
                request_scale_value()]
        step = asyncio.ensure_future(gen.asend("wait"))
        await asyncio.sleep(0)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        await gen.aclose()
        return seen

    assert asyncio.run(main()) == [0.25, 0.25, "caught", 1.0]
    assert _shared() == 1.0


def test_anything_but_a_generator_is_refused():
    with pytest.raises(InvalidOptionError, match="pass a generator"):
        shuttle.scaled_stream([1, 2])
    with pytest.raises(InvalidOptionError, match="not a generator"):
        shuttle.scaled_stream(lambda: [1, 2])()
