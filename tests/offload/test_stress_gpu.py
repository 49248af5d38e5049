"""Streaming under stress on the GPU: every residency plan, compute or copies made slow, hundreds
of steps, each step's output equal bit for bit to the resident model's.

A race between the copy stream and the compute stream shows only when one of them runs far
ahead of the other, so each test slows one side down with ``torch.cuda._sleep``: in every
block's forward (the copy stream runs ahead: a copy that does not wait for the slot's last
reader overwrites weights still in use) or before every copy (compute runs ahead: a block that
does not wait for its copy reads the slot's previous block). The host queues all steps without
a synchronization (outputs are compared at the end), and the inputs rotate so that each step's
output is new. The blocks are small and many, so each ring slot is reused hundreds of times.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import shuttle
from shuttle import ModelCache, ModelSpec, StreamConfig
from shuttle.offload import ModelOffloader
from shuttle.offload.host_unit import HostUnit

pytestmark = pytest.mark.gpu

N_BLOCKS = 8
DIM = 128
STEPS = 200
# GPU cycles per sleep (about 0.5 ms): longer than the host takes to queue a block, so the
# slowed stream falls behind the host and the other one runs ahead of it.
SLEEP = 1_000_000


class SleepyBlock(nn.Module):
    """A residual MLP whose forward can first keep the compute stream busy (``sleep``)."""

    sleep = 0  # cycles, set per test

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if SleepyBlock.sleep:
            torch.cuda._sleep(SleepyBlock.sleep)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(SleepyBlock() for _ in range(N_BLOCKS))
        self.head = nn.Linear(DIM, DIM)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def adapter() -> shuttle.LoRA:
    g = torch.Generator().manual_seed(7)
    sd = {}
    for i in range(N_BLOCKS):
        sd[f"blocks.{i}.up.lora_A.weight"] = torch.randn(4, DIM, generator=g) * 0.1
        sd[f"blocks.{i}.up.lora_B.weight"] = torch.randn(2 * DIM, 4, generator=g) * 0.1
    return shuttle.load_lora(sd)


@pytest.fixture
def inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, DIM, generator=g).cuda() for _ in range(5)]


@pytest.fixture(params=["slow_compute", "slow_copies"])
def slowed(request, monkeypatch):
    """Which side is slowed: block forwards, or every host->device copy (on the copy stream)."""
    if request.param == "slow_compute":
        monkeypatch.setattr(SleepyBlock, "sleep", SLEEP)
    else:
        copy_into = HostUnit.copy_into

        def slow_copy(self, flat, views, non_blocking, decoder=None):
            torch.cuda._sleep(SLEEP)  # queued on the copy stream, before the copy
            copy_into(self, flat, views, non_blocking, decoder)

        monkeypatch.setattr(HostUnit, "copy_into", slow_copy)
    return request.param


def references(model: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The resident model's output for each input (same kernels, same sleeps)."""
    with torch.no_grad():
        return [model(x) for x in inputs]


def run_steps(model: nn.Module, inputs: list[torch.Tensor], steps: int = STEPS
              ) -> list[torch.Tensor]:
    """``steps`` calls, the inputs rotating, no host synchronization in between."""
    with torch.no_grad():
        return [model(inputs[k % len(inputs)]) for k in range(steps)]


def assert_all_equal(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> None:
    torch.cuda.synchronize()
    bad = [k for k, y in enumerate(outs) if not torch.equal(y, refs[k % len(refs)])]
    assert not bad, f"{len(bad)} of {len(outs)} steps differ from the resident model: {bad[:10]}"


def sizes(off: ModelOffloader) -> tuple[int, int]:
    """(bytes of the non-block weights, bytes of one block slot)."""
    return off.storage.rest.layout.nbytes, off.storage.groups["blocks"][0].layout.nbytes


def block_plans() -> dict[str, dict]:
    plans: dict[str, dict] = {"whole": {"stream": None}}
    for p in (0, 1, 2):
        plans[f"stream_p{p}"] = {"stream": StreamConfig(prefetch=p)}
    # Budgets leaving r blocks resident. A ring as large as the streamed rest costs what making
    # those blocks resident costs, and the planner then keeps them all: the ring shrinks to one
    # slot (prefetch 0) for r = n - 2, and r = n - 1 can only be asked for by count.
    for r in range(1, N_BLOCKS - 1):
        plans[f"budget_r{r}"] = {"resident": r, "prefetch": 1 if r < N_BLOCKS - 2 else 0}
    plans[f"resident_r{N_BLOCKS - 1}"] = {"stream": StreamConfig(prefetch=0,
                                                                 resident=N_BLOCKS - 1)}
    return plans


@pytest.mark.parametrize("plan", list(block_plans()))
def test_block_streaming_is_bit_exact_at_every_residency(plan, slowed, inputs):
    model = Net(0)
    refs = references(copy.deepcopy(model).cuda(), inputs)
    off = ModelOffloader.from_module(model, blocks="blocks")
    spec = block_plans()[plan]
    stream = spec.get("stream")
    if "resident" in spec:
        rest, block = sizes(off)
        r, p = spec["resident"], spec["prefetch"]
        assert r + min(p + 1, N_BLOCKS - r) < N_BLOCKS
        stream = StreamConfig(prefetch=p,
                              vram_budget=rest + (r + min(p + 1, N_BLOCKS - r)) * block)
    with off.use("cuda", stream) as m:
        if "resident" in spec:
            assert len(off.plan.resident["blocks"]) == spec["resident"]
        outs = run_steps(m, inputs)
        assert_all_equal(outs, refs)


@pytest.mark.parametrize("keep", [0, 3, 9])
def test_layer_streaming_is_bit_exact(keep, slowed, inputs):
    model = Net(1)
    refs = references(copy.deepcopy(model).cuda(), inputs)
    off = ModelOffloader.from_module(model, layers=True)
    with off.use("cuda", StreamConfig(prefetch=1, resident=keep)) as m:
        assert len(off.plan.layers) == keep
        assert_all_equal(run_steps(m, inputs), refs)


def test_a_cache_switching_models_every_step_is_bit_exact(slowed, inputs):
    nets = [Net(2), Net(3)]
    refs = [references(copy.deepcopy(n).cuda(), inputs) for n in nets]
    cache = ModelCache(max_bytes=2**30)
    specs = [ModelSpec(f"net{i}", factory=lambda n=n: n, blocks=["blocks"])
             for i, n in enumerate(nets)]
    outs: list[list[torch.Tensor]] = [[], []]
    stream = StreamConfig(prefetch=1, resident=2)
    with torch.no_grad():
        for k in range(STEPS // 2):  # each step activates one model and deactivates it
            i = k % 2
            with cache.use(specs[i], "cuda", stream=stream) as m:
                outs[i].append(m(inputs[(k // 2) % len(inputs)]))
    for i in (0, 1):
        assert_all_equal(outs[i], refs[i])


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
@pytest.mark.parametrize("resident", [0, 3])
def test_adapters_while_streaming_are_bit_exact(mode, resident, slowed, inputs):
    model, lora = Net(4), adapter()
    ref = copy.deepcopy(model).cuda()
    if mode == "merge":
        shuttle.merge_lora(ref, [(lora, 0.8)])
        scope = contextlib.nullcontext()
    else:
        scope = shuttle.apply_lora(ref, [(lora, 0.8)], mode="dynamic")
    with scope:
        refs = references(ref, inputs)
    off = ModelOffloader.from_module(model, blocks="blocks")
    with off.use("cuda", StreamConfig(prefetch=1, resident=resident), loras=[(lora, 0.8)],
                 mode=mode) as m:
        assert_all_equal(run_steps(m, inputs), refs)
