"""The counters of launches whose programs wait for each other: zero before and after every
launch, one set per stream for eager launches, a set of its own for each captured launch.

On CPU the decode kernels run under TRITON_INTERPRET=1 (set in conftest).
"""

from __future__ import annotations

import pytest
import torch

from shuttle.kernels import triton_available
from shuttle.kernels.lora_decode import (
    PreparedLoraDecode,
    lora_decode_add,
    lora_decode_add_reference,
    lora_decode_linear,
    lora_decode_linear_reference,
)
from shuttle.kernels.semaphore import launch_semaphore

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


def _layer(t, k, n, r, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).bfloat16().to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16().to(device)
    b = torch.randn(n, generator=g).bfloat16().to(device)
    down = (torch.randn(r, k, generator=g) / k**0.5).bfloat16().to(device)
    up = (torch.randn(n, r, generator=g) * 0.3).bfloat16().to(device)
    scale = (0.25 + torch.rand(r, generator=g)).to(device)
    return x, w, b, down, up, scale


def test_counters_are_zero_after_each_launch_and_launches_repeat():
    x, w, b, down, up, scale = _layer(5, 80, 48, 12, "cpu")
    sem = launch_semaphore(torch.device("cpu"))
    assert sem is launch_semaphore(torch.device("cpu")) and sem.dtype == torch.int32
    base = torch.randn(5, 48).bfloat16()
    want_add = lora_decode_add_reference(base.clone(), x, down, up, scale)
    want_linear = lora_decode_linear_reference(x, w, b, down, up, scale)
    for _ in range(3):  # a launch that left its counters set would spoil the next one
        assert torch.equal(lora_decode_add(base.clone(), x, down, up, scale), want_add)
        assert not sem.any()
        assert torch.equal(lora_decode_linear(x, w, b, down, up, scale), want_linear)
        assert not sem.any()


def test_a_launch_leaves_no_trace_for_the_next_layer():
    # two layers of different widths and ranks alternate on one stream's counters
    first, second = _layer(3, 64, 80, 8, "cpu", seed=1), _layer(16, 96, 32, 20, "cpu", seed=2)
    preps = [PreparedLoraDecode(c[3], c[4]) for c in (first, second)]
    for _ in range(2):
        for (x, w, b, down, up, scale), prep in zip((first, second), preps, strict=True):
            assert torch.equal(prep.linear(x, w, b, scale),
                               lora_decode_linear_reference(x, w, b, down, up, scale))
    assert not launch_semaphore(torch.device("cpu")).any()


@pytest.mark.gpu
def test_one_set_per_stream_and_one_per_captured_launch():
    dev = torch.device("cuda", torch.cuda.current_device())
    main = launch_semaphore(dev)
    assert main is launch_semaphore(dev, capturing=False)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = launch_semaphore(dev)
    assert other.data_ptr() != main.data_ptr()
    captured = {launch_semaphore(dev, capturing=True).data_ptr() for _ in range(5)}
    assert len(captured) == 5 and main.data_ptr() not in captured


@pytest.mark.gpu
def test_graphs_replayed_at_once_on_two_streams_beside_eager_launches():
    # Both graphs are captured on torch's one capture stream: with that stream's counters in
    # both, replays running at once would take each other's tickets.
    x, w, b, down, up, scale = _layer(16, 4096, 6144, 16, "cuda")
    prep = PreparedLoraDecode(down, up)
    want_linear = prep.linear(x, w, b, scale)
    want_add = prep.add(torch.nn.functional.linear(x, w, b), x, scale)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            prep.linear(x, w, b, scale)
            prep.add(torch.nn.functional.linear(x, w, b), x, scale)
    torch.cuda.current_stream().wait_stream(side)
    graphs, outs = [], []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append([prep.linear(x, w, b, scale) for _ in range(4)]
                        + [prep.add(torch.nn.functional.linear(x, w, b), x, scale)])
        graphs.append(graph)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(50):
        for graph, stream in zip(graphs, streams, strict=True):
            with torch.cuda.stream(stream):
                graph.replay()
        eager = prep.linear(x, w, b, scale)  # on the current stream, beside the replays
        torch.cuda.synchronize()
        for got in outs:
            assert all(torch.equal(o, want_linear) for o in got[:4])
            assert torch.equal(got[4], want_add)
        assert torch.equal(eager, want_linear)
    assert not launch_semaphore(x.device).any()
