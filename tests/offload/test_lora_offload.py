"""Adapters during activation: merged as weights land, or dynamic, against a resident reference."""

from __future__ import annotations

import copy

import pytest
import torch

import shuttle
from shuttle.errors import (
    InvalidOptionError,
    InvalidStrengthError,
    NonFiniteAdapterError,
    OffloadError,
    ShapeMismatchError,
)
from shuttle.hooks import hooks_of
from shuttle.offload import ModelOffloader, SlotPool, StreamConfig
from shuttle.offload import adapters as adapters_module
from tests import lowrank_state
from tests.offload.models import RESIDENCY_MODES, TinyDiT, fail_on_call
from tests.offload.test_host_storage import assert_unchanged, snapshot

PATHS = ["blocks", "single"]

MODES = RESIDENCY_MODES



def adapters(dtype=torch.float32):
    """Low-rank on every ``blocks`` block; dense diffs in the rest, a block and a single."""
    g = torch.Generator().manual_seed(3)
    low = lowrank_state({f"blocks.{i}.{name}": shape for i in range(5)
                         for name, shape in {"attn": (32, 32), "up": (128, 32)}.items()},
                        generator=g)
    low = {k: v.to(dtype) for k, v in low.items()}
    dense = {"norm.diff": torch.randn(32, generator=g) * 0.1,
             "blocks.1.norm.diff": torch.randn(32, generator=g) * 0.1,
             "single.2.down.diff": torch.randn(32, 64, generator=g) * 0.01,
             "single.2.down.diff_b": torch.randn(32, generator=g) * 0.01}
    return [(shuttle.load_lora(low), 0.8), (shuttle.load_lora(dense), 0.5)]


def setup(dtype=torch.float32, host="pinned"):
    """(pristine reference, offloader, adapters)."""
    model = TinyDiT(dtype=dtype)
    ref = copy.deepcopy(model)
    return ref, ModelOffloader.from_module(model, blocks=PATHS, host=host), adapters()


def tokens():
    return torch.randint(0, 64, (2, 9))


def no_hooks(model):
    return all(hooks_of(m) == [] and "forward" not in m.__dict__ for m in model.modules())


def check_pristine_and_reusable(off, ref, before, stream):
    """After deactivate: host weights bit-identical, no hooks, original outputs again."""
    assert not off.active and off.adapters is None
    assert no_hooks(off.model)
    assert_unchanged(off.model, before)
    x = tokens()
    with off.use("cpu", stream) as model, torch.no_grad():
        assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("host", ["pinned", "adopt"])
@pytest.mark.parametrize("mode", list(MODES))
def test_merge_mode_is_bit_identical_to_merge_lora(cpu_copy, mode, host, dtype):
    ref, off, loras = setup(dtype, host)
    merged = copy.deepcopy(ref)
    report = shuttle.merge_lora(merged, loras)
    before = snapshot(off.model)
    x = tokens()
    with torch.no_grad():
        want = merged(x)
        assert not torch.equal(want, ref(x))
        with off.use("cpu", MODES[mode], loras=loras) as model:
            assert off.adapters.mode == "merge"
            assert off.adapters.report.applied == report.applied
            for _ in range(3):  # streamed blocks are loaded (and merged) again every step
                assert torch.equal(model(x), want)
    check_pristine_and_reusable(off, ref, before, MODES[mode])


@pytest.mark.parametrize("quality", ["exact", "lossless"])
@pytest.mark.parametrize("mode", list(MODES))
def test_dynamic_mode_equals_attach_lora(cpu_copy, mode, quality):
    ref, off, loras = setup()
    before = snapshot(off.model)
    x = tokens()
    with torch.no_grad():
        handle = shuttle.attach_lora(ref, loras, quality=quality)
        want = ref(x)
        handle.detach()
        with off.use("cpu", MODES[mode], loras=loras, mode="dynamic",
                     quality=quality) as model:
            assert off.adapters.mode == "dynamic" and off.adapters.folds == 0
            assert set(off.adapters.handle.hooks) == {n.rpartition(".")[0] for n in
                                                      handle.applied}
            for _ in range(3):
                assert torch.equal(model(x), want)
    check_pristine_and_reusable(off, ref, before, MODES[mode])


@pytest.mark.parametrize("mode", list(MODES))
def test_auto_mode_equals_apply_lora_auto(cpu_copy, mode):
    """bf16 weights at a threshold between the parameters' losses (the low-rank updates lose
    about 1% to bf16 rounding and merge, the dense diffs 2-4% and stay dynamic): outputs and
    decisions equal ``apply_lora(mode="auto")`` on a resident copy."""
    ref, off, loras = setup(torch.bfloat16)
    before = snapshot(off.model)
    x = tokens()
    with torch.no_grad():
        with shuttle.apply_lora(ref, loras, mode="auto", auto_threshold=0.015) as report:
            want = ref(x)
            decisions = report.decisions
        assert set(decisions.values()) == {"merge", "dynamic"}  # the test covers both paths
        with off.use("cpu", MODES[mode], loras=loras, mode="auto",
                     auto_threshold=0.015) as model:
            assert {n: d.mode for n, d in off.adapters.decisions.items()} == decisions
            assert off.adapters.merges and off.adapters.dynamic
            for _ in range(2):
                assert torch.equal(model(x), want)
    check_pristine_and_reusable(off, ref, before, MODES[mode])


def test_auto_threshold_must_be_a_finite_fraction(cpu_copy):
    _, off, loras = setup()
    with pytest.raises(InvalidStrengthError, match="auto_threshold"):
        off.activate("cpu", loras=loras, mode="auto", auto_threshold=float("nan"))
    assert not off.active


@pytest.mark.parametrize("mode", ["merge", "dynamic", "auto"])
def test_cpu_pass_through_applies_and_restores(mode):
    ref, off, loras = setup()
    before = snapshot(off.model)
    x = tokens()
    with torch.no_grad():
        with shuttle.apply_lora(ref, loras, mode=mode):
            want = ref(x)
        with off.use("cpu", StreamConfig(), loras=loras, mode=mode) as model:
            assert off.plan is None
            assert torch.equal(model(x), want)
    check_pristine_and_reusable(off, ref, before, None)


def test_a_reloaded_block_is_merged_once_per_load(cpu_copy, monkeypatch):
    ref, off, loras = setup()
    merged = copy.deepcopy(ref)
    shuttle.merge_lora(merged, loras)
    loaded = []
    original = SlotPool.load

    def load(self, slot, unit):
        loaded.append(unit.name)
        return original(self, slot, unit)

    monkeypatch.setattr(SlotPool, "load", load)
    x = tokens()
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=1), loras=loras) as model:
        for _ in range(2):  # 5 blocks through 2 slots: every block is reloaded each step
            assert torch.equal(model(x), merged(x))
        per_unit = {u: len(t) for u, t in off.adapters._targets.items()}
        assert loaded.count("blocks.0") >= 2
        assert off.adapters.folds == sum(per_unit.get(u, 0) for u in loaded)


def test_zero_strengths_are_dropped_before_anything_is_built(cpu_copy, monkeypatch):
    ref, off, loras = setup()
    monkeypatch.setattr(adapters_module, "plan_params", None)  # would fail if called
    x = tokens()
    with torch.no_grad():
        for mode in ("merge", "dynamic"):
            with off.use("cpu", StreamConfig(prefetch=1), mode=mode,
                         loras=[(lora, 0.0) for lora, _ in loras]) as model:
                assert off.adapters is None
                assert torch.equal(model(x), ref(x))


def bad_adapters():
    g = torch.Generator().manual_seed(4)
    ok = {"blocks.0.attn.lora_A.weight": torch.randn(4, 32, generator=g),
          "blocks.0.attn.lora_B.weight": torch.randn(32, 4, generator=g)}
    wrong_shape = {"blocks.0.attn.lora_A.weight": torch.randn(4, 31, generator=g),
                   "blocks.0.attn.lora_B.weight": torch.randn(32, 4, generator=g)}
    nan = dict(ok, **{"blocks.0.attn.lora_B.weight": torch.full((32, 4), float("nan"))})
    return [
        (dict(loras=[(wrong_shape, 1.0)]), ShapeMismatchError),
        (dict(loras=[(nan, 1.0)]), NonFiniteAdapterError),
        (dict(loras=[(ok, float("inf"))]), InvalidStrengthError),
        (dict(loras=[(ok, 1.0)], mode="sometimes"), InvalidOptionError),
        (dict(loras=[(ok, 1.0)], mode="dynamic", quality="best"), OffloadError),
    ]


@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("stream", [None, StreamConfig(prefetch=1)])
def test_bad_adapters_raise_before_any_change(cpu_copy, monkeypatch, case, stream):
    ref, off, _ = setup()
    before = snapshot(off.model)
    pools = []
    monkeypatch.setattr(SlotPool, "__init__", _spy(SlotPool.__init__, pools))
    kwargs, err = bad_adapters()[case]
    with pytest.raises(err):
        off.activate("cpu", stream, **kwargs)
    assert pools == []  # no device memory was taken for weights
    monkeypatch.undo()
    check_pristine_and_reusable(off, ref, before, stream)


def _spy(fn, calls):
    def wrapper(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("mode,where", [("merge", "merge_param"),
                                             ("dynamic", "add_hook")])
@pytest.mark.parametrize("n", [1, 3, 6])  # merge: 6 merges at activation
def test_a_failure_in_the_lora_step_rolls_back(cpu_copy, monkeypatch, mode, where, n):
    ref, off, loras = setup()
    before = snapshot(off.model)
    with monkeypatch.context() as m:
        m.setattr(adapters_module, where, fail_on_call(n, getattr(adapters_module, where)))
        with pytest.raises(RuntimeError, match="injected"):
            off.activate("cpu", StreamConfig(prefetch=1), loras=loras, mode=mode)
    check_pristine_and_reusable(off, ref, before, StreamConfig(prefetch=1))
    merged = copy.deepcopy(ref)
    shuttle.merge_lora(merged, loras)
    x = tokens()
    if mode == "merge":  # the same adapters work once the failure is gone
        with off.use("cpu", StreamConfig(prefetch=1), loras=loras) as model, torch.no_grad():
            assert torch.equal(model(x), merged(x))


def test_dynamic_hooks_compose_with_a_streamed_block_that_is_adapted_itself(cpu_copy):
    # Blocks that are Linears: the stream hook and the LoRA hook sit on one module.
    torch.manual_seed(1)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    lora = {f"{i}.lora_A.weight": torch.randn(2, 16, generator=g) * 0.1 for i in range(4)}
    lora |= {f"{i}.lora_B.weight": torch.randn(16, 2, generator=g) * 0.1 for i in range(4)}
    off = ModelOffloader.from_module(model, blocks="")
    x = torch.randn(3, 16)
    with torch.no_grad():
        with shuttle.apply_lora(ref, [(lora, 0.7)], mode="dynamic"):
            want = ref(x)
        with off.use("cpu", StreamConfig(prefetch=1), loras=[(lora, 0.7)],
                     mode="dynamic") as m:
            assert all(len(hooks_of(b)) == 2 for b in m)
            assert torch.equal(m(x), want)
    assert no_hooks(model)


def test_a_failing_merge_while_streaming_leaves_the_activation_usable(cpu_copy, monkeypatch):
    ref, off, loras = setup()
    merged = copy.deepcopy(ref)
    shuttle.merge_lora(merged, loras)
    x = tokens()
    # 6 merges at activation (rest, then blocks 0 and 1 into the ring); the 8th is a prefetch.
    monkeypatch.setattr(adapters_module, "merge_param",
                        fail_on_call(8, adapters_module.merge_param))
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=1), loras=loras) as model:
        with pytest.raises(RuntimeError, match="injected"):
            model(x)
        for _ in range(2):
            assert torch.equal(model(x), merged(x))
    assert no_hooks(off.model)


def test_the_former_lora_mode_keyword_warns_and_works(cpu_copy):
    ref, off, loras = setup()
    x = tokens()
    with off.use("cpu", StreamConfig(prefetch=1), loras=loras, mode="dynamic") as model, \
            torch.no_grad():
        want = model(x)
    with pytest.warns(FutureWarning, match="lora_mode= is now mode="), \
            off.use("cpu", StreamConfig(prefetch=1), loras=loras, lora_mode="dynamic") as model, \
            torch.no_grad():
        assert torch.equal(model(x), want)
        assert off.adapters.mode == "dynamic"
    with pytest.raises(OffloadError, match="give mode= only"), pytest.warns(FutureWarning), \
            off.use("cpu", loras=loras, mode="auto", lora_mode="dynamic"):
        pass
