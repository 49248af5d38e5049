"""The counters and workspace of launches whose programs wait for each other (the decode
update): counters zero before and after every launch, one set per stream for eager launches, a
set of their own for each captured launch.

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
)
from shuttle.kernels.semaphore import launch_scratch

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


def _layer(t, k, n, r, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).bfloat16().to(device)
    out = torch.randn(t, n, generator=g).bfloat16().to(device)
    down = (torch.randn(r, k, generator=g) / k**0.5).bfloat16().to(device)
    up = (torch.randn(n, r, generator=g) * 0.3).bfloat16().to(device)
    scale = (0.25 + torch.rand(r, generator=g)).to(device)
    return out, x, down, up, scale


def test_counters_are_zero_after_each_launch_and_launches_repeat():
    out, x, down, up, scale = _layer(5, 80, 48, 12, "cpu")
    sem, ws = launch_scratch(torch.device("cpu"), 16)
    assert sem.dtype == torch.int32 and ws.dtype == torch.float32 and ws.numel() >= 16
    want = lora_decode_add_reference(out.clone(), x, down, up, scale)
    for _ in range(3):  # a launch that left its counters set would spoil the next one
        assert torch.equal(lora_decode_add(out.clone(), x, down, up, scale), want)
        assert launch_scratch(torch.device("cpu"), 16)[0] is sem and not sem.any()


def test_a_launch_leaves_no_trace_for_the_next_layer():
    # two layers of different sizes alternate on one stream's counters and workspace
    layers = [_layer(3, 64, 80, 8, "cpu", seed=1), _layer(16, 96, 32, 20, "cpu", seed=2)]
    preps = [PreparedLoraDecode(c[2], c[3]) for c in layers]
    for _ in range(2):
        for (out, x, down, up, scale), prep in zip(layers, preps, strict=True):
            assert torch.equal(prep.add(out.clone(), x, scale),
                               lora_decode_add_reference(out.clone(), x, down, up, scale))
    assert not launch_scratch(torch.device("cpu"), 0)[0].any()


def test_a_larger_workspace_replaces_the_streams_one():
    _, small = launch_scratch(torch.device("cpu"), 8)
    sem, large = launch_scratch(torch.device("cpu"), small.numel() + 1)
    assert large.numel() > small.numel()
    again = launch_scratch(torch.device("cpu"), 8)
    assert again[0] is sem and again[1] is large


@pytest.mark.gpu
def test_one_set_per_stream_and_one_per_captured_launch():
    dev = torch.device("cuda", torch.cuda.current_device())
    main = launch_scratch(dev, 64)
    assert main[0] is launch_scratch(dev, 64, capturing=False)[0]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = launch_scratch(dev, 64)
    assert other[0].data_ptr() != main[0].data_ptr()
    assert other[1].data_ptr() != main[1].data_ptr()
    captured = [launch_scratch(dev, 64, capturing=True) for _ in range(5)]
    assert len({c[0].data_ptr() for c in captured} | {main[0].data_ptr()}) == 6
    assert not any(c[0].any() for c in captured)


@pytest.mark.gpu
def test_graphs_replayed_at_once_on_two_streams_beside_eager_launches():
    # Both graphs are captured on torch's one capture stream: with that stream's counters in
    # both, replays running at once would take each other's tickets.
    _, x, down, up, scale = _layer(16, 4096, 6144, 16, "cuda")
    w = (torch.randn(6144, 4096, device="cuda") / 64).bfloat16()
    prep = PreparedLoraDecode(down, up)
    want = prep.add(torch.nn.functional.linear(x, w), x, scale)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            prep.add(torch.nn.functional.linear(x, w), x, scale)
    torch.cuda.current_stream().wait_stream(side)
    graphs, outs = [], []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append([prep.add(torch.nn.functional.linear(x, w), x, scale)
                         for _ in range(4)])
        graphs.append(graph)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(50):
        for graph, stream in zip(graphs, streams, strict=True):
            with torch.cuda.stream(stream):
                graph.replay()
        eager = prep.add(torch.nn.functional.linear(x, w), x, scale)  # beside the replays
        torch.cuda.synchronize()
        assert all(torch.equal(o, want) for got in outs for o in got)
        assert torch.equal(eager, want)
    assert not launch_scratch(x.device, 0)[0].any()
