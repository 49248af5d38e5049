"""``shuttle.lora_scale`` belongs to the thread or task that set it; compiled code reads the
shared tensor and follows changes without recompiling (tests/apply/test_dynamic.py)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading

import pytest
import torch
from torch import nn

import shuttle
from shuttle.apply.scale import request_scale, request_scale_value, shared_request_scale
from tests import lowrank_state


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


def test_eager_tensors_are_bounded_however_many_scales_requests_pass():
    # A server passing a scale per request: the per-value tensors are an LRU of a fixed size,
    # and one dropped keeps the value a queued read saw (the scales: exact in float32).
    from shuttle.apply import scale

    dev = torch.device("cpu")
    with shuttle.lora_scale(0.5):
        first = request_scale(dev)
    seen = []
    for i in range(10_000):
        with shuttle.lora_scale(1.0 + i * 2.0**-14):
            t = request_scale(dev)
            assert float(t) == 1.0 + i * 2.0**-14 and request_scale(dev) is t
            if i % 1000 == 0:
                seen.append((t, 1.0 + i * 2.0**-14))
        assert len(scale._by_value) <= scale.MAX_CACHED_SCALES
    assert float(first) == 0.5 and all(float(t) == v for t, v in seen)
    with shuttle.lora_scale(0.5):
        assert float(request_scale(dev)) == 0.5


class _Request:
    """A thread that runs one request step by step, each step when the test says: the test
    orders the threads' steps exactly (no timing), and each step's result comes back."""

    def __init__(self):
        self._steps: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._open: list[contextlib.AbstractContextManager] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while (step := self._steps.get()) is not None:
            try:
                self._results.put((True, step()))
            except BaseException as e:  # handed to the test's thread
                self._results.put((False, e))

    def do(self, step):
        self._steps.put(step)
        ok, value = self._results.get(timeout=30)
        if not ok:
            raise value
        return value

    def enter(self, scale: float) -> None:
        """Open a ``lora_scale(scale)`` scope in the thread (nested in any still open)."""
        scope = shuttle.lora_scale(scale)
        self.do(scope.__enter__)
        self._open.append(scope)

    def exit(self) -> None:
        """Close the thread's innermost open scope."""
        scope = self._open.pop()
        self.do(lambda: scope.__exit__(None, None, None))

    def stop(self):
        while self._open:  # a failed test's scopes too: they close where they opened
            self.exit()
        self._steps.put(None)
        self._thread.join(30)


def _adapted(kind: str, quality: str):
    """A model with one adapter on one layer: low-rank on a Linear (the tiers), low-rank on a
    Conv2d (its own residual), or LoHa on a Linear (the float32 weight residual); its input."""
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    if kind == "conv":
        m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1))
        sd = {"0.lora_down.weight": torch.randn(2, 3, 3, 3, generator=g),
              "0.lora_up.weight": torch.randn(8, 2, 1, 1, generator=g)}
        x = torch.randn(2, 3, 5, 5, generator=g)
    else:
        m = nn.Sequential(nn.Linear(16, 24))
        sd = lowrank_state({"0": (24, 16)}, generator=g, scale=0.5) if kind == "linear" else {
            "lycoris_0.hada_w1_a": torch.randn(24, 2, generator=g),
            "lycoris_0.hada_w1_b": torch.randn(2, 16, generator=g),
            "lycoris_0.hada_w2_a": torch.randn(24, 2, generator=g),
            "lycoris_0.hada_w2_b": torch.randn(2, 16, generator=g)}
        x = torch.randn(3, 16, generator=g)
    return m, shuttle.attach_lora(m, [(sd, 1.0)], quality=quality), x


@pytest.mark.parametrize("quality", ["exact", "lossless", "fused"])
@pytest.mark.parametrize("kind", ["linear", "conv", "loha"])
def test_each_thread_recomputes_with_its_own_scale(kind, quality):
    """Two requests inside different scales at once, the layer's cached scales made stale
    (a strength set) between them: each forward computes its scale afresh and must read its own
    thread's, not the one another thread entered last (what compiled code reads)."""
    m, handle, x = _adapted(kind, quality)
    want = {}
    for s in (0.5, 2.0, 1.0):
        with shuttle.lora_scale(s):
            want[s] = m(x).detach()
    assert not torch.equal(want[0.5], want[2.0])
    a, b = _Request(), _Request()
    try:
        a.enter(0.5)
        b.enter(2.0)  # entered last: the process-wide value is now 2
        handle.set_strength(0, 1.0)  # same strength, new generation: cached scales are stale
        assert torch.equal(a.do(lambda: m(x).detach()), want[0.5])
        assert torch.equal(m(x), want[1.0])  # this thread opened no scope
        a.enter(0.5)  # a nested scope of a: the process-wide value is now 0.5
        handle.set_strength(0, 1.0)
        assert torch.equal(b.do(lambda: m(x).detach()), want[2.0])
        assert torch.equal(a.do(lambda: m(x).detach()), want[0.5])
    finally:
        a.stop()
        b.stop()
    handle.detach()


def test_the_shared_scale_is_the_latest_open_scope_whatever_order_scopes_close_in():
    """The shared tensor (what compiled code and CUDA graphs read, see
    test_dynamic.py::test_compiled_model_does_not_recompile_on_strength_scale_or_swap) holds
    the scale of the most recently opened scope still open: requests' scopes close in any
    order, and once all have closed it is 1 again."""
    def shared() -> float:
        return float(shared_request_scale(torch.device("cpu")))

    a, b = _Request(), _Request()
    try:
        a.enter(0.5)
        b.enter(2.0)
        assert shared() == 2.0
        a.exit()  # the first opened closes first: b's scope is still open
        assert shared() == 2.0
        b.exit()
        assert shared() == 1.0
        a.enter(0.5)
        b.enter(2.0)
        b.exit()
        assert shared() == 0.5
    finally:
        a.stop()
        b.stop()
    assert shared() == 1.0


def test_another_threads_forward_between_computing_and_using_the_scales(monkeypatch):
    """Thread B runs a whole forward at its own scale at the moment thread A's layer has
    computed A's scale vector and not yet used it: A still adds its own scale's update (the
    layer's cache of the vector is one object per key, never a key read apart from its
    vector)."""
    import shuttle.apply.scale_vector as scale_vector

    m, handle, x = _adapted("linear", "lossless")
    want = {}
    for s in (0.5, 2.0):
        with torch.no_grad(), shuttle.lora_scale(s):
            want[s] = m(x)
    b = _Request()
    b.enter(2.0)
    main, ran = threading.get_ident(), []
    shared = scale_vector.shared_request_scale

    def shared_then_b(device):  # called while A computes its vectors
        if threading.get_ident() == main and not ran:
            ran.append(b.do(lambda: torch.equal(m(x).detach(), want[2.0])))
        return shared(device)

    monkeypatch.setattr(scale_vector, "shared_request_scale", shared_then_b)
    try:
        handle.set_strength(0, 1.0)  # stale: A recomputes
        with torch.no_grad(), shuttle.lora_scale(0.5):
            got = m(x)
    finally:
        b.stop()
    assert ran == [True], "the other thread's forward did not run in between"
    assert torch.equal(got, want[0.5])
    handle.detach()


def test_a_scope_closed_in_another_context_still_leaves_the_shared_scale():
    """An unwrapped generator opened in one context and closed in another (what
    shuttle.scaled_stream prevents): Python refuses to reset the context variable there, and
    the scope still leaves the shared scale of compiled code."""
    def stream():
        with shuttle.lora_scale(0.5):
            yield

    gen = stream()
    contextvars.copy_context().run(next, gen)
    assert float(shared_request_scale(torch.device("cpu"))) == 0.5
    with pytest.raises(ValueError, match="different Context"):
        gen.close()
    assert float(shared_request_scale(torch.device("cpu"))) == 1.0


def test_a_scale_vector_told_of_a_capture_hands_out_the_vector_later_changes_rewrite(monkeypatch):
    # The auto tier asks once per call whether a CUDA graph is being captured and passes the
    # answer on: told so, the vector must not ask again, and must hand out the layer's own
    # vector, which a later strength change rewrites in place (what a replay reads).
    from shuttle.apply.scale_vector import ScaleVector
    from shuttle.apply.strength import Strengths

    strengths = Strengths([0.5])
    vector = ScaleVector(strengths)
    vector.base_scale, vector.col_adapter = torch.tensor([2.0, 4.0]), torch.tensor([0, 0])
    cpu = torch.device("cpu")
    eager = vector(cpu, capturing=False)
    assert eager.tolist() == [1.0, 2.0]

    def asked(*args, **kwargs):
        raise AssertionError("asked again")

    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_current_stream_capturing", asked)
        m.setattr(torch.compiler, "is_compiling", asked)
        captured = vector(cpu, capturing=True)
    assert captured is not eager and captured.tolist() == [1.0, 2.0]
    strengths.set({0: 0.25})
    assert captured.tolist() == [0.5, 1.0]  # rewritten in place for the graph's replays
    assert eager.tolist() == [1.0, 2.0]  # the eager vector is never written
    assert vector(cpu, capturing=True) is captured
    assert vector(cpu, capturing=False).tolist() == [0.5, 1.0]
