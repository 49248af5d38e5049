"""``StreamConfig(compile=...)``: block forwards compiled, weight loading outside the graph.

The CPU tests use dynamo with the ``eager`` backend (through ``CompileCounter``, which counts
the graphs dynamo hands it): it exercises tracing, guards and recompilation exactly as inductor
would, without inductor's C++ build time on a 2-core CI machine.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from shuttle.hooks import hooks_of
from shuttle.offload import ModelOffloader, StreamConfig
from tests.offload.models import TinyDiT

PATHS = ["blocks", "single"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_blocks_compile_once_per_class_and_shape_and_match_eager(cpu_copy):
    model = TinyDiT()
    ref = copy.deepcopy(model)
    off = ModelOffloader.from_module(model, blocks=PATHS)
    counter = CompileCounter()
    x = torch.randint(0, 64, (2, 9))
    cfg = StreamConfig(prefetch=1, resident=1, compile=counter)  # streamed and resident
    with torch.no_grad(), off.use("cpu", cfg) as m:
        assert torch.equal(m(x), ref(x))
        # One graph per block width (blocks: hidden 128, single: hidden 64), shared by the
        # blocks of a group whatever slot their weights sit in.
        assert counter.frame_count == 2
        for _ in range(3):
            assert torch.equal(m(x), ref(x))
        assert counter.frame_count == 2  # no recompiles after warm-up
        assert off.streamers["blocks"].loads > 0  # and the blocks really streamed
    assert all(hooks_of(b) == [] and "forward" not in b.__dict__ for b in model.blocks)


def test_the_hooks_run_outside_the_graph(cpu_copy):
    model = TinyDiT()
    off = ModelOffloader.from_module(model, blocks=PATHS)
    counter = CompileCounter()
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=1, compile=counter)) as m:
        calls = []
        s = off.streamers["blocks"]
        original = s.before
        s.before = lambda i: (calls.append(i), original(i))[1]
        m(torch.randint(0, 64, (2, 9)))
        m(torch.randint(0, 64, (2, 9)))
        assert calls == [0, 1, 2, 3, 4] * 2  # called eagerly on every step, never traced away
        # The graphs hold the block's math only: no copy into a slot was traced.
        assert counter.op_count > 0
    assert not off.active


def test_compile_with_training_gives_the_eager_gradients(cpu_copy):
    from torch.utils.checkpoint import checkpoint

    model = TinyDiT()
    ref = copy.deepcopy(model)
    off = ModelOffloader.from_module(model, blocks=PATHS)
    x = torch.randint(0, 64, (2, 9))

    def run(m):
        h = m.embed(x)
        for b in [*m.blocks, *m.single]:
            h = checkpoint(b, h, use_reentrant=False)
        return m.head(m.norm(h)).square().mean()

    run(ref).backward()
    with off.use("cpu", StreamConfig(prefetch=1, compile="aot_eager")) as m:
        run(m).backward()
        got = dict(m.named_parameters())
        for n, q in ref.named_parameters():
            torch.testing.assert_close(got[n].grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_a_list_whose_blocks_differ_compiles_and_matches_eager(cpu_copy):
    from tests.offload.models import TinyT5

    model = TinyT5()
    ref = copy.deepcopy(model)
    off = ModelOffloader.from_module(model, blocks="block")
    counter = CompileCounter()
    x = torch.randint(0, 64, (2, 9))
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=1, compile=counter)) as m:
        for _ in range(3):
            assert torch.equal(m(x), ref(x))
        # The first block (its table, no bias given) and the others: two graphs, whatever
        # slot of the shared ring their weights sit in.
        assert counter.frame_count == 2
        assert off.streamers["block"].loads > 5
