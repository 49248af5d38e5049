from __future__ import annotations

import copy
import gc
import inspect
import time
import weakref

import pytest
import torch

import shuttle
from shuttle import hooks as hooks_module
from shuttle.errors import (
    AlreadyActiveError,
    BlockLayoutError,
    BlockPathError,
    BudgetTooSmallError,
    HostBackingError,
    OffloadError,
)
from shuttle.hooks import hooks_of
from shuttle.offload import ModelOffloader, SlotPool, StreamConfig
from tests.offload.models import RESIDENCY_MODES, TinyDiT, fail_on_call
from tests.offload.test_host_storage import assert_unchanged, snapshot

PATHS = ["blocks", "single"]



def pair(dtype=torch.float32, host="pinned"):
    model = TinyDiT(dtype=dtype)
    ref = copy.deepcopy(model)
    return ref, ModelOffloader.from_module(model, blocks=PATHS, host=host)


def tokens():
    return torch.randint(0, 64, (2, 9))


def pointers_into(off, module):
    """Record, during forward, whether ``module``'s tensors lie in an activation slot."""
    seen = []

    def hook(m, args):
        bufs = [b for p in off._active.pools for b in p.buffers]
        seen.append(all(any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel()
                            for b in bufs) for t in [*m.parameters(), *m.buffers()]))

    return seen, module.register_forward_pre_hook(hook)


MODES = RESIDENCY_MODES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("host", ["pinned", "adopt"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_matches_the_resident_model(cpu_copy, mode, host, dtype):
    ref, off = pair(dtype, host)
    x = tokens()
    with torch.no_grad():
        want = ref(x)
        with off.use("cpu", MODES[mode]) as model:
            seen, handle = pointers_into(off, model.blocks[3].up)
            for _ in range(3):  # steady state, wrapping the ring across steps
                assert torch.equal(model(x), want)
            handle.remove()
        assert seen and all(seen)  # weights really came through the device slots
        assert torch.equal(off.model(x), want)  # and after deactivate, from the host


def test_two_block_lists_are_separate_groups(cpu_copy):
    _, off = pair()
    with off.use("cpu", StreamConfig(prefetch=1)):
        pools = {g: s.pool for g, s in off.streamers.items()}
        assert set(pools) == set(PATHS)
        assert pools["blocks"].layout != pools["single"].layout
        assert pools["blocks"].n_slots == pools["single"].n_slots == 2


def test_cpu_activation_is_a_pass_through():
    ref, off = pair()
    before = snapshot(off.model)
    with off.use("cpu", StreamConfig(prefetch=2)) as model, torch.no_grad():
        assert off.active and off.plan is None and off.streamers == {}
        assert all(hooks_of(b) == [] for b in model.blocks)
        x = tokens()
        assert torch.equal(model(x), ref(x))
    assert_unchanged(off.model, before)


def test_an_activation_left_unwaited_is_readied_before_its_forward(cpu_copy):
    ref, off = pair()
    x = tokens()
    for ready in (True, False):  # ended unreadied, it is taken down all the same
        off.activate("cpu", StreamConfig(prefetch=1, resident=2), wait=False)
        resident = sum(map(len, off.plan.resident.values())) + 1  # and the rest
        assert len(off._active.unready) == resident  # placed, nothing waited for yet
        if ready:
            off.ready()
            assert off._active.unready is None  # waited for: later loads wait at once
            with torch.no_grad():
                assert torch.equal(off.model(x), ref(x))
        off.deactivate()
    with off.use("cpu", StreamConfig(prefetch=1, resident=2)):
        assert off._active.unready is None  # waited for at once by default


def device_bytes_held(off: ModelOffloader) -> int:
    """Bytes of every device buffer the current activation allocated, counted from the slot
    pools themselves (not from the planner's ``device_bytes``)."""
    return sum(b.numel() * b.element_size() for p in off._active.pools for b in p.buffers)


def test_budget_chooses_resident_counts(cpu_copy):
    _, off = pair()
    rest = off.storage.rest.layout.nbytes
    block = off.storage.groups["blocks"][0].layout.nbytes
    single = off.storage.groups["single"][0].layout.nbytes
    total = rest + 5 * block + 3 * single
    counts = []
    for budget in [rest + block + single, rest + 3 * block + 3 * single, total - 1, total]:
        with off.use("cpu", StreamConfig(prefetch=2, vram_budget=budget)):
            plan = off.plan
            held = device_bytes_held(off)
            assert held <= budget, f"the activation holds {held} device bytes, budget {budget}"
            assert plan.device_bytes == held  # and the plan reports what it holds
            counts.append(sum(len(r) for r in plan.resident.values()))
            if budget == rest + block + single:
                assert plan.prefetch == 0 and plan.ring == {"blocks": 1, "single": 1}
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 8
    with off.use("cpu", StreamConfig(vram_budget=total)):
        assert off.streamers == {}  # everything fits: nothing streams


def test_resident_blocks_are_spread_evenly(cpu_copy):
    _, off = pair()
    with off.use("cpu", StreamConfig(resident=2)):
        assert off.plan.resident == {"blocks": (1, 3), "single": (0, 2)}


def test_budget_below_one_block_raises_before_any_change(cpu_copy):
    _, off = pair()
    before = snapshot(off.model)
    need = off.storage.rest.layout.nbytes + sum(
        us[0].layout.nbytes for us in off.storage.groups.values())
    with pytest.raises(BudgetTooSmallError, match=f"at least {need} bytes"):
        off.activate("cpu", StreamConfig(vram_budget=need - 1))
    assert not off.active
    assert all(hooks_of(b) == [] for b in off.model.blocks)
    assert_unchanged(off.model, before)


def test_tied_weights_stay_tied_on_the_device(cpu_copy):
    ref, off = pair()
    with off.use("cpu", StreamConfig()) as model:
        assert model.head.weight is model.embed.weight
        pool = off._active.pools[0]
        assert model.embed.weight.data_ptr() == pool.views[0][0].data_ptr()
        assert sum(v.data_ptr() == model.embed.weight.data_ptr() for v in pool.views[0]) == 1


def test_overlapping_activation_raises(cpu_copy):
    _, off = pair()
    with off.use("cpu", StreamConfig()):
        with pytest.raises(AlreadyActiveError, match="deactivate"):
            off.activate("cpu")
        with pytest.raises(AlreadyActiveError), off.use("cpu"):
            pass
        assert off.active  # the failed attempts left the first activation alone
    assert not off.active


def test_deactivate_releases_slots_and_restores_forward_exactly(cpu_copy):
    ref, off = pair()
    model = off.model
    sig = inspect.signature(model.blocks[0].forward)
    host_ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    off.activate("cpu", StreamConfig(prefetch=1))
    buffers = [weakref.ref(b) for p in off._active.pools for b in p.buffers]
    assert "forward" in model.blocks[0].__dict__
    with torch.no_grad():
        model(tokens())
    off.deactivate()
    gc.collect()
    assert all(r() is None for r in buffers)
    assert off.streamers == {} and off.plan is None and off.device is None
    for b in [*model.blocks, *model.single]:
        assert "forward" not in b.__dict__ and hooks_of(b) == []
        assert inspect.signature(b.forward) == sig
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == host_ptrs
    off.deactivate()  # a second deactivate does nothing


@pytest.mark.parametrize("where", ["copy", "hook"])
@pytest.mark.parametrize("n", [1, 3, 5])  # 5 loads: rest, 2 + 2 ring slots
def test_a_failing_activation_rolls_back(cpu_copy, monkeypatch, where, n):
    ref, off = pair()
    host_ptrs = {k: v.data_ptr() for k, v in off.model.state_dict().items()}
    with monkeypatch.context() as m:
        if where == "copy":
            m.setattr(SlotPool, "load", fail_on_call(n, SlotPool.load))
        else:
            m.setattr(hooks_module, "add_hook", fail_on_call(n, hooks_module.add_hook))
        with pytest.raises(RuntimeError, match="injected"):
            off.activate("cpu", StreamConfig(prefetch=1))
    assert not off.active
    for b in [*off.model.blocks, *off.model.single]:
        assert "forward" not in b.__dict__ and hooks_of(b) == []
    assert {k: v.data_ptr() for k, v in off.model.state_dict().items()} == host_ptrs
    x = tokens()
    with off.use("cpu", StreamConfig(prefetch=1)) as model, torch.no_grad():  # usable again
        assert torch.equal(model(x), ref(x))


def test_a_raising_forward_leaves_the_activation_usable(cpu_copy):
    ref, off = pair()
    with off.use("cpu", StreamConfig(prefetch=1)) as model, torch.no_grad():
        with pytest.raises(IndexError):
            model(torch.full((1, 3), 1000))
        x = tokens()
        assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("blocks,err,match", [
    (["nope"], BlockPathError, "names no submodule"),
    (["norm"], BlockPathError, "not a non-empty"),
    (["blocks", "blocks"], BlockPathError, "twice"),
    (["blocks", "blocks.1"], BlockPathError, "not a non-empty"),
])
def test_bad_block_paths_raise_before_any_change(blocks, err, match):
    model = TinyDiT()
    before = snapshot(model)
    with pytest.raises(err, match=match):
        ModelOffloader.from_module(model, blocks=blocks)
    assert_unchanged(model, before)


def test_nested_block_lists_raise():
    model = TinyDiT()
    model.blocks[0].inner = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(BlockPathError, match="overlaps"):
        ModelOffloader.from_module(model, blocks=["blocks", "blocks.0.inner"])


def test_other_bad_inputs_raise_before_any_change():
    model = TinyDiT()
    before = snapshot(model)
    tied = TinyDiT()
    tied.single[0].up.weight = tied.blocks[0].up.weight  # one tensor in two units
    with pytest.raises(BlockLayoutError):
        ModelOffloader.from_module(tied, blocks=PATHS)
    with pytest.raises(OffloadError, match="host="):
        ModelOffloader.from_module(model, blocks=PATHS, host="mmap")
    with pytest.raises(HostBackingError, match="adopt"):
        ModelOffloader.from_module(TinyDiT().to("meta"), blocks=PATHS, host="adopt")
    for bad in [dict(prefetch=-1), dict(resident=1.5), dict(resident=1, vram_budget=10),
                dict(vram_budget="10 G"), dict(vram_budget=-1e9)]:
        with pytest.raises(OffloadError):
            StreamConfig(**bad)
    assert_unchanged(model, before)
    # a budget as users spell it, kept as whole bytes
    assert StreamConfig(vram_budget="1.5MiB").vram_budget == 3 * 2**19
    assert StreamConfig(vram_budget=2e6).vram_budget == 2_000_000


def test_exports():
    assert shuttle.ModelOffloader is ModelOffloader and shuttle.StreamConfig is StreamConfig


@pytest.mark.parametrize("layers", [False, True], ids=["blocks", "layers"])
@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_an_ended_activation_is_freed_at_once(cpu_copy, layers, mode):
    """An activation holds no reference cycle: with the garbage collector off, its adapters
    (with their device copies of the factors), streamers and pools are freed when it ends. (A
    streamer and its saved-tensor guard referring to each other kept every merge activation's
    factor copies until a collection ran: 3584 more bytes per activation in the GPU test
    below.)"""
    from tests.integrations.models import random_lora

    model = TinyDiT()
    off = (ModelOffloader.from_module(model, layers=True) if layers
           else ModelOffloader.from_module(model, blocks=PATHS))
    lora = random_lora({"blocks.1.attn": (32, 32), "blocks.3.up": (128, 32)}, rank=4,
                       scale=0.3, seed=1)
    gc.collect()
    gc.disable()
    try:
        with off.use("cpu", StreamConfig(prefetch=1), loras=[(lora, 0.8)], mode=mode) as m:
            m(tokens()).sum()  # in grad mode: the saved-tensor guard packs slot views
            active = off._active
            parts = [active, active.adapters, *active.pools, *active.streamers.values(),
                     *([active.layer_streamer] if active.layer_streamer else [])]
            assert len(parts) > 3
            refs = [weakref.ref(p) for p in parts]
            del active, parts
        alive = [type(r()).__name__ for r in refs if r() is not None]
    finally:
        gc.enable()
    assert not alive, f"kept alive after the activation ended: {alive}"


@pytest.mark.gpu
def test_every_activation_copies_on_one_stream_and_merges_leave_no_memory_behind():
    # cuBLAS keeps a workspace for every stream a matmul ran on; merges run on the copy
    # stream, so a new copy stream per activation would leave one more workspace each time.
    from tests.integrations.models import random_lora

    _, off = pair()
    lora = random_lora({"blocks.1.attn": (32, 32), "blocks.3.up": (128, 32)}, rank=4,
                       scale=0.3, seed=1)
    x = tokens().cuda()
    streams, held, live = set(), [], []
    torch.cuda.memory._record_memory_history(stacks="python")
    try:
        for _ in range(4):
            with off.use("cuda", StreamConfig(prefetch=1), loras=[(lora, 0.8)],
                         mode="merge") as model, torch.no_grad():
                model(x)
                streams.update(id(p._stream) for p in off._active.pools)
            torch.cuda.synchronize()
            held.append(torch.cuda.memory_allocated())
            live.append(_live_blocks())
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert len(streams) == 1
    # the message names where each block left behind by the later activations was allocated
    left = "\n".join(f"{size} B at {where}" for address, (size, where) in live[-1].items()
                     if address not in live[0])
    assert held[1:] == held[:1] * 3, f"device bytes held after each activation: {held}\n{left}"


def _live_blocks() -> dict[int, tuple[int, str]]:
    """Address -> (size, innermost shuttle/test frames) of every allocated CUDA block."""
    out = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
                      for f in block.get("frames", [])
                      if "shuttle" in f["filename"] or "tests" in f["filename"]]
            out[block["address"]] = (block["size"], " < ".join(frames[:6]))
    return out


@pytest.mark.gpu
def test_an_activation_left_unwaited_keeps_the_compute_stream_free_of_its_copies():
    # The copy stream is held back by a sleeping kernel: an activation that waits holds every
    # later kernel of the compute stream behind its copies, one left unwaited does not, and
    # ready() then orders the forward after them (the sanitizer checks that order).
    from shuttle.offload.activation import copy_stream_of

    ref, off = pair(torch.bfloat16)
    ref, x = ref.cuda(), tokens().cuda()
    with torch.no_grad():
        want = ref(x)
    for wait in (False, True):
        torch.cuda.synchronize()
        with torch.cuda.stream(copy_stream_of(torch.device("cuda", 0))):
            torch.cuda._sleep(2_000_000_000)  # about a second at the H100's clocks
        off.activate("cuda", StreamConfig(prefetch=1, resident=2), wait=wait)
        done = torch.cuda.Event()
        done.record()  # on the compute stream, after the activation
        deadline = time.perf_counter() + 0.3
        while not done.query() and time.perf_counter() < deadline:
            time.sleep(0.001)
        assert done.query() is not wait, f"wait={wait}"
        off.ready()
        with torch.no_grad():
            assert torch.equal(off.model(x), want)
        off.deactivate()
