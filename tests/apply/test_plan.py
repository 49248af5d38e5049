"""plan_params: an adapter's placement is remembered, and forgotten wherever it could be wrong."""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
from torch import nn

import shuttle
from shuttle.apply import checks as checks_mod
from shuttle.apply import plan as plan_mod
from shuttle.apply.memo import MergeMemo, clear_memo, memo_of
from shuttle.errors import ShapeMismatchError
from shuttle.patches import LowRank


def _model(out_f: int = 12, in_f: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(in_f, out_f), nn.ReLU(), nn.Linear(out_f, 6))


def _lora(out_f: int = 12, in_f: int = 8, seed: int = 1) -> shuttle.LoRA:
    g = torch.Generator().manual_seed(seed)
    return shuttle.load_lora({
        "0.lora_A.weight": torch.randn(4, in_f, generator=g),
        "0.lora_B.weight": torch.randn(out_f, 4, generator=g),
        "2.lora_A.weight": torch.randn(4, out_f, generator=g),
        "2.lora_B.weight": torch.randn(6, 4, generator=g),
    })


@pytest.fixture
def plan():
    """plan_params with one model's memo, as plan_merge and merge_lora pass it."""
    return functools.partial(plan_mod.plan_params, memo=MergeMemo())


@pytest.fixture
def resolves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of resolve() made by planning."""
    calls: list[int] = []
    real = plan_mod.resolve

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_mod, "resolve", counting)
    return calls


def test_second_plan_reuses_the_placement_and_gives_the_same_plan(resolves, plan):
    model, lora = _model(), _lora()
    params = dict(model.named_parameters())
    first = plan(params, [(lora, 0.5)])
    second = plan(params, [(lora, 2.0)])
    assert len(resolves) == 1
    assert first.params.keys() == second.params.keys() == {"0.weight", "2.weight"}
    for name in first.params:
        (a,), (b,) = first.params[name], second.params[name]
        assert a.patch is b.patch and (a.strength, b.strength) == (0.5, 2.0)


def test_cached_merge_equals_a_fresh_one(resolves):
    lora = _lora()
    model = _model()
    shuttle.merge_lora(model, [(lora, 1.0)])
    shuttle.merge_lora(model, [(lora, -1.0)])  # planned from the cache
    shuttle.merge_lora(model, [(lora, 0.75)])
    fresh = _model()
    shuttle.merge_lora(fresh, [(_lora(), 1.0)])
    shuttle.merge_lora(fresh, [(_lora(), -1.0)])
    shuttle.merge_lora(fresh, [(_lora(), 0.75)])
    assert len(resolves) == 4
    for (n, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_changed_shapes_resolve_again_and_fail_validation(resolves, plan):
    lora = _lora()
    plan(dict(_model().named_parameters()), [(lora, 1.0)])
    wider = dict(_model(out_f=16).named_parameters())
    with pytest.raises(ShapeMismatchError):
        plan(wider, [(lora, 1.0)])
    with pytest.raises(ShapeMismatchError):  # a failed validation is not remembered
        plan(wider, [(lora, 1.0)])
    assert len(resolves) == 3


def test_changed_names_resolve_again(resolves, plan):
    lora = _lora()
    plan(dict(_model().named_parameters()), [(lora, 1.0)])
    renamed = {f"transformer.{n}": p for n, p in _model().named_parameters()}
    plan = plan(renamed, [(lora, 1.0)])
    assert len(resolves) == 2
    assert set(plan.params) == {"transformer.0.weight", "transformer.2.weight"}


def test_edited_adapter_resolves_again(resolves, plan):
    lora = _lora()
    params = dict(_model().named_parameters())
    plan(params, [(lora, 1.0)])
    del lora.modules["2"]
    got = plan(params, [(lora, 1.0)])
    assert set(got.params) == {"0.weight"}
    (old,) = lora.modules["0"]
    lora.modules["0"] = [LowRank("weight", old.up * 2, old.down, scale=old.scale)]
    got = plan(params, [(lora, 1.0)])
    assert got.params["0.weight"][0].patch is lora.modules["0"][0]
    assert len(resolves) == 3


def test_a_mapping_is_never_cached(resolves, plan):
    lora = _lora()
    params = dict(_model().named_parameters())
    for _ in range(2):
        plan(params, [(lora, 1.0)], mapping={"0": "0"})
    assert len(resolves) == 2


def test_the_entry_dies_with_its_adapter(plan):
    lora = _lora()
    p = plan(dict(_model().named_parameters()), [(lora, 1.0)])
    assert len(p.memo.placements) == 1
    del lora, p
    gc.collect()
    assert len(plan.keywords["memo"].placements) == 0


def test_each_model_owns_its_memo_and_clearing_it_resolves_again(resolves):
    a, b, lora = _model(), _model(), _lora()
    shuttle.merge_lora(a, [(lora, 0.5)])
    shuttle.merge_lora(b, [(lora, 0.5)])  # another model: its own memo, resolved afresh
    assert len(resolves) == 2 and memo_of(a) is not memo_of(b)
    assert len(memo_of(a).placements) == len(memo_of(b).placements) == 1
    shuttle.merge_lora(a, [(lora, 0.5)])
    assert len(resolves) == 2
    clear_memo(a)
    assert len(memo_of(a)) == 0 and len(memo_of(b).placements) == 1
    shuttle.merge_lora(a, [(lora, 0.5)])
    assert len(resolves) == 3


def test_without_a_memo_nothing_is_kept(resolves):
    lora = _lora()
    params = dict(_model().named_parameters())
    for _ in range(2):
        plan_mod.plan_params(params, [(lora, 1.0)])
    assert len(resolves) == 2


def test_the_memo_dies_with_its_model():
    model = _model()
    shuttle.merge_lora(model, [(_lora(), 1.0)])
    ref = weakref.ref(memo_of(model))
    del model
    gc.collect()
    assert ref() is None


def test_patches_loaded_elsewhere_are_loaded_each_time(plan):
    lora = _lora()
    params = dict(_model().named_parameters())
    meta = {n: p.to("meta") for n, p in params.items()}
    plan(params, [(lora, 1.0)])  # resident on the CPU
    with pytest.raises(shuttle.errors.UnsupportedLayerError, match="meta device"):
        plan(meta, [(lora, 1.0)])
    plan = plan(meta, [(lora, 1.0)], device="cpu")
    assert plan.params["0.weight"][0].patch is lora.modules["0"][0]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_huge_finite_adapter_passes_the_finite_check(device, plan):
    # values near float32's limit (their sum would overflow): finite, and measured as such
    lora = _lora()
    (patch,) = lora.modules["0"]
    lora.modules["0"] = [LowRank("weight", torch.full_like(patch.up, 3e38), patch.down,
                                 scale=patch.scale)]
    params = {n: p.to(device) for n, p in _model().named_parameters()}
    plan = plan(params, [(lora, 1.0)])
    assert plan.params["0.weight"][0].patch.up.isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_the_one_non_finite_tensor_is_named(device, dtype, value, plan):
    lora = _lora()
    (patch,) = lora.modules["2"]
    down = patch.down.clone()
    down[1, 3] = value
    lora.modules["2"] = [LowRank("weight", patch.up.to(dtype), down.to(dtype), scale=patch.scale)]
    params = {n: p.to(device) for n, p in _model().named_parameters()}
    with pytest.raises(shuttle.errors.NonFiniteAdapterError, match=r"'2'.*'down'"):
        plan(params, [(lora, 1.0)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", [0, 40_000, 99_999])
def test_nan_anywhere_in_a_large_tensor_among_many_is_found(device, where):
    """The screen is one multi-tensor max per device: NaN must win it wherever it lies (the
    first, a middle or the last element of 100k, past one block of the reduction)."""
    tensors = [torch.randn(100_000, device=device).bfloat16() for _ in range(12)]
    tensors[7][where] = float("nan")
    maxima = checks_mod._screen(tensors)
    assert [i for i, m in enumerate(maxima) if m != m] == [7]
    assert all(0 < m < 10 for i, m in enumerate(maxima) if i != 7)


def test_an_adapter_edited_in_place_after_a_merge_is_checked_again():
    """The finite-check memory is keyed on each tensor's version: a NaN written into a factor
    of an adapter that was already merged once is found before the second merge writes any of
    the targets (the edited one is merged last, after the others)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 10), nn.ReLU(),
                          nn.Linear(10, 6))
    g = torch.Generator().manual_seed(2)
    lora = shuttle.load_lora({f"{i}.{f}.weight": torch.randn(*shape, generator=g)
                              for i, (o, n) in {0: (12, 8), 2: (10, 12), 4: (6, 10)}.items()
                              for f, shape in (("lora_A", (3, n)), ("lora_B", (o, 3)))})
    report = shuttle.merge_lora(model, [(lora, 0.5)])
    assert report.applied == ["0.weight", "2.weight", "4.weight"]  # the merge order
    (patch,) = lora.modules["4"]
    patch.down[1, 2] = float("nan")  # in place: same tensor object, a new version
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(shuttle.errors.NonFiniteAdapterError) as info:
        shuttle.merge_lora(model, [(lora, 0.5)])
    for n, p in model.named_parameters():  # bit for bit, NaN payloads and signed zeros too
        assert torch.equal(p.detach().view(torch.int32), before[n].view(torch.int32)), (
            f"{n} changed before the error: {info.value}")
    assert "'4'" in str(info.value) and "'down'" in str(info.value)  # the planner's check
