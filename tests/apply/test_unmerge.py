"""unmerge_lora: exactly from what merge_lora(keep=...) kept (in reverse order of the kept
merges, never over a parameter written or replaced since, unless forced), or by subtraction
within its reported bound, which is the documented one; on DTensor shards too (gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import (
    DeviceUnavailableError,
    InvalidOptionError,
    ParameterChangedError,
    ScopeOrderError,
    ShapeMismatchError,
    ShuttleError,
    WideningError,
)
from tests import assert_unchanged, snapshot
from tests.ranks import backends, run_ranks


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
    return model.to(dtype)


def _lora(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{i}.lora_{p}.weight": torch.randn(*s, generator=g) * 0.2
            for i, (o, n) in (("0", (48, 32)), ("2", (16, 48)))
            for p, s in (("A", (4, n)), ("B", (o, 4)))}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_a_kept_merge_is_undone_bit_for_bit(dtype):
    model = _model(torch.float32)
    if dtype == torch.float8_e4m3fn:  # float8 weights, float32 biases
        for layer in (model[0], model[2]):
            layer.weight.data = layer.weight.data.to(dtype)
    else:
        model = model.to(dtype)
    before = snapshot(model)
    report = shuttle.merge_lora(model, [(_lora(), 0.8)], keep=True)
    assert {k: v.device.type for k, v in report.kept.items()} == {
        "0.weight": "cpu", "2.weight": "cpu"}
    assert any(not torch.equal(v.float(), before[k].float()) for k, v in snapshot(model).items())
    undone = shuttle.unmerge_lora(model, report)
    assert undone.exact and undone.restored == ["0.weight", "2.weight"]
    assert_unchanged(model, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_subtraction_lands_within_the_reported_bound(dtype):
    model = _model(dtype)
    before = snapshot(model)
    loras = [(_lora(), 0.8), (_lora(2), {"0": 0.5, "2": 0.0})]
    shuttle.merge_lora(model, loras)
    undone = shuttle.unmerge_lora(model, loras)
    assert not undone.exact and sorted(undone.restored) == ["0.weight", "2.weight"]
    for name in undone.restored:
        err = float((model.state_dict()[name].double() - before[name].double()).abs().max())
        assert err <= undone.error_bound[name], name
    if dtype == torch.bfloat16:  # two roundings moved something: the bound is not vacuous
        assert any(not torch.equal(model.state_dict()[n], before[n]) for n in undone.restored)
        assert all(0 < b < 0.05 for b in undone.error_bound.values())


def test_a_report_that_kept_nothing_says_how():
    model = _model(torch.bfloat16)
    report = shuttle.merge_lora(model, [(_lora(), 1.0)])
    with pytest.raises(ShuttleError, match="keep=True"):
        shuttle.unmerge_lora(model, report)


def test_a_subtraction_cannot_undo_a_weight_dependent_patch():
    """(IA)3 scales the weight: merging it at -m is no inverse, so the subtraction is refused
    (nothing written) and the kept report undoes it exactly."""
    model = _model(torch.float32)
    ia3 = {"0.weight": torch.rand(48) + 0.5, "0.on_input": torch.tensor(False)}
    report = shuttle.merge_lora(model, [(ia3, 1.0)], keep=True)
    merged = snapshot(model)
    with pytest.raises(ShuttleError, match="ia3 patches.*keep=True"):
        shuttle.unmerge_lora(model, [(ia3, 1.0)])
    assert_unchanged(model, merged)
    assert shuttle.unmerge_lora(model, report).exact


def test_a_changed_parameter_is_refused_and_nothing_is_written():
    model = _model(torch.bfloat16)
    report = shuttle.merge_lora(model, [(_lora(), 1.0)], keep=True)
    model[2].weight = nn.Parameter(torch.zeros(16, 48, dtype=torch.float16))
    merged = snapshot(model)
    with pytest.raises(ShapeMismatchError, match="'2.weight' changed"):
        shuttle.unmerge_lora(model, report)
    assert_unchanged(model, merged)


def test_keep_on_a_widening_merge_is_refused_before_any_change():
    model = nn.Sequential()
    model.x_embedder = nn.Linear(4, 8)
    with pytest.raises((WideningError, ShuttleError)):
        shuttle.merge_lora(model, [({"x_embedder.lora_A.weight": torch.ones(2, 6),
                                     "x_embedder.lora_B.weight": torch.ones(8, 2)}, 1.0)],
                           keep=True)
    assert model.x_embedder.weight.shape == (8, 4)


def _ulp(top: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype`` just above ``top`` (a value of ``dtype``)."""
    t = torch.tensor(top, dtype=dtype)
    return float(torch.nextafter(t, torch.tensor(float("inf"), dtype=dtype)) - t)


@pytest.mark.parametrize(("dtype", "rounding", "steps"), [
    (torch.bfloat16, None, 1), (torch.float16, None, 1), (torch.bfloat16, "stochastic", 2),
    (torch.float32, None, 2), (torch.float32, "stochastic", 4)])
def test_the_subtraction_bound_is_the_documented_one_and_tight(dtype, rounding, steps):
    # The bound is `steps` ulps at the largest magnitude the weight held merged or holds after:
    # one for nearest, two for stochastic, doubled for float32. Not merely an upper bound of
    # the error: the error here reaches an eighth of it or more.
    model = _model(dtype)
    before = snapshot(model)
    loras = [(_lora(), 0.8)]
    shuttle.merge_lora(model, loras, rounding=rounding)
    merged = snapshot(model)
    undone = shuttle.unmerge_lora(model, loras, rounding=rounding)
    for name in ("0.weight", "2.weight"):
        now = model.state_dict()[name]
        top = max(float(merged[name].abs().max()), float(now.abs().max()))
        bound = undone.error_bound[name]
        assert bound == steps * _ulp(top, dtype), name
        err = float((now.double() - before[name].double()).abs().max())
        assert bound / 8 <= err <= bound, name


def _two_kept(dtype=torch.bfloat16):
    model = _model(dtype)
    before = snapshot(model)
    first = shuttle.merge_lora(model, [(_lora(1), 1.0)], keep=True)
    second = shuttle.merge_lora(model, [(_lora(2), 1.0)], keep=True)
    return model, before, first, second


def test_kept_merges_undone_in_reverse_order_give_the_original_back():
    model, before, first, second = _two_kept()
    assert shuttle.unmerge_lora(model, second).exact
    assert shuttle.unmerge_lora(model, first).exact
    assert_unchanged(model, before)


def test_an_out_of_order_undo_is_refused_and_nothing_is_written():
    model, before, first, second = _two_kept()
    both = snapshot(model)
    with pytest.raises(ScopeOrderError, match="later kept merge.*reverse order"):
        shuttle.unmerge_lora(model, first)
    assert_unchanged(model, both)
    shuttle.unmerge_lora(model, second)  # then in order: the original, no adapter resurrected
    shuttle.unmerge_lora(model, first)
    assert_unchanged(model, before)


def test_a_later_kept_merge_of_one_parameter_orders_that_parameter_only():
    model = _model(torch.bfloat16)
    first = shuttle.merge_lora(model, [(_lora(1), 1.0)], keep=True)
    lora2 = {k: v for k, v in _lora(2).items() if k.startswith("2.")}
    second = shuttle.merge_lora(model, [(lora2, 1.0)], keep=True)
    assert list(second.kept) == ["2.weight"]
    with pytest.raises(ScopeOrderError, match="^'2.weight': a later"):
        shuttle.unmerge_lora(model, first)


def test_forcing_an_out_of_order_undo_says_what_it_discarded():
    model, before, first, second = _two_kept()
    undone = shuttle.unmerge_lora(model, first, force=True)
    assert sorted(undone.discarded) == ["0.weight", "2.weight"]
    assert all("later kept merge" in why for why in undone.discarded.values())
    assert_unchanged(model, before)
    with pytest.raises(ParameterChangedError):  # its copy holds the first merge: refused
        shuttle.unmerge_lora(model, second)
    assert_unchanged(model, before)


@pytest.mark.parametrize("how", ["in place", "merge", "subtraction"])
def test_a_parameter_written_since_the_merge_is_refused_naming_it(how):
    model = _model(torch.bfloat16)
    report = shuttle.merge_lora(model, [(_lora(1), 1.0)], keep=True)
    if how == "in place":
        with torch.no_grad():
            model[2].weight.mul_(2)
    elif how == "merge":
        shuttle.merge_lora(model, [({k: v for k, v in _lora(2).items() if k.startswith("2.")},
                                    1.0)])
    else:
        shuttle.unmerge_lora(model, [({k: v for k, v in _lora(1).items()
                                       if k.startswith("2.")}, 1.0)])
    changed = snapshot(model)
    with pytest.raises(ParameterChangedError, match="^since the merge, '2.weight' was written"
                       ) as info:
        shuttle.unmerge_lora(model, report)
    assert list(info.value.changed) == ["2.weight"]
    assert_unchanged(model, changed)
    undone = shuttle.unmerge_lora(model, report, force=True)
    assert list(undone.discarded) == ["2.weight"]
    assert torch.equal(model[2].weight, report.kept["2.weight"])


def test_a_replaced_parameter_of_the_same_shape_is_refused():
    model = _model(torch.bfloat16)
    report = shuttle.merge_lora(model, [(_lora(1), 1.0)], keep=True)
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    with pytest.raises(ParameterChangedError, match="'0.weight' was replaced"):
        shuttle.unmerge_lora(model, report)


def test_a_second_undo_of_one_merge_is_refused():
    model = _model(torch.bfloat16)
    report = shuttle.merge_lora(model, [(_lora(1), 1.0)], keep=True)
    shuttle.unmerge_lora(model, report)
    shuttle.merge_lora(model, [(_lora(2), 1.0)])
    merged = snapshot(model)
    with pytest.raises(ScopeOrderError, match="undone already"):
        shuttle.unmerge_lora(model, report)
    assert_unchanged(model, merged)


def test_an_undo_under_an_open_scoped_merge_is_refused_even_forced():
    model = _model(torch.bfloat16)
    before = snapshot(model)
    report = shuttle.merge_lora(model, [(_lora(1), 1.0)], keep=True)
    with shuttle.apply_lora(model, [(_lora(2), 1.0)]):
        inside = snapshot(model)
        with pytest.raises(ScopeOrderError, match="apply_lora.*still open"):
            shuttle.unmerge_lora(model, report, force=True)
        assert_unchanged(model, inside)
    shuttle.unmerge_lora(model, report)  # the block restored the kept merge's weights
    assert_unchanged(model, before)


def test_a_dropped_later_report_leaves_its_merge_for_good():
    model, before, first, second = _two_kept()
    del second  # that merge can no longer be undone exactly: it stays like a plain merge
    with pytest.raises(ParameterChangedError, match="was written"):
        shuttle.unmerge_lora(model, first)


@pytest.mark.parametrize(("keep", "error", "match"), [
    ("banana", InvalidOptionError, "keep='banana' names no device: pass keep=True"),
    (None, InvalidOptionError, "keep=None: pass keep=True"),
    (1, InvalidOptionError, "keep=1: pass keep=True"),
    ("meta", InvalidOptionError, "meta device holds no values"),
    ("cuda:64", DeviceUnavailableError, "keep='cuda:64'.*keep=True"),
])
def test_a_bad_keep_is_refused_naming_the_choices(keep, error, match):
    model = _model(torch.bfloat16)
    before = snapshot(model)
    with pytest.raises(error, match=match):
        shuttle.merge_lora(model, [(_lora(), 1.0)], keep=keep)
    assert_unchanged(model, before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_keep_cuda_without_cuda_is_refused():
    model = _model(torch.bfloat16)
    before = snapshot(model)
    with pytest.raises(DeviceUnavailableError, match="no cuda device.*keep=True"):
        shuttle.merge_lora(model, [(_lora(), 1.0)], keep="cuda")
    assert_unchanged(model, before)


@pytest.mark.parametrize("merged", [None, 3, "style.safetensors"])
def test_unmerge_of_neither_a_report_nor_adapters_says_what_to_pass(merged):
    with pytest.raises(InvalidOptionError, match="pass the MergeReport of merge_lora"):
        shuttle.unmerge_lora(_model(torch.bfloat16), merged)


def _sharded_case(rank, world, spec):
    """Kept and subtracted undos of merges into DTensor shards (placements ``spec``)."""
    from torch.distributed.tensor import distribute_tensor

    from tests.apply.test_sharded import _mesh, _placements

    model = _model(torch.bfloat16)
    for lin in (model[0], model[2]):
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), _mesh(world, (world,)),
                                                    _placements(spec)), requires_grad=False)
    weights = [model[0].weight, model[2].weight]
    before = [w.full_tensor() for w in weights]
    first = shuttle.merge_lora(model, [(_lora(1), 1.0)], keep=True)
    second = shuttle.merge_lora(model, [(_lora(2), 0.5)], keep=True)
    merged = [w.full_tensor() for w in weights]
    try:
        shuttle.unmerge_lora(model, first)
        order = None
    except ScopeOrderError as e:
        order = str(e)
    unchanged = all(torch.equal(w.full_tensor(), m) for w, m in zip(weights, merged, strict=True))
    exact = shuttle.unmerge_lora(model, second).exact and shuttle.unmerge_lora(model, first).exact
    kept = [w.full_tensor() for w in weights]
    loras = [(_lora(1), 1.0)]
    shuttle.merge_lora(model, loras)
    undone = shuttle.unmerge_lora(model, loras)
    errors = {n: float((w.to_local().double() - b.double()[_window(w, n)]).abs().max())
              for n, w, b in zip(("0.weight", "2.weight"), weights, before, strict=True)}
    report = shuttle.merge_lora(model, loras, keep=True)
    other = _placements("S1" if spec == "S0" else "S0")
    model[0].weight = nn.Parameter(model[0].weight.redistribute(placements=other),
                                   requires_grad=False)
    with pytest.raises(ShapeMismatchError, match="'0.weight' was resharded"):
        shuttle.unmerge_lora(model, report)
    return order, unchanged, exact, before, kept, errors, undone.error_bound


def _window(w, name):
    from shuttle.weights.dtensor import shard_window

    win = shard_window(w, name)
    return tuple(slice(a, b) for a, b in zip(win.starts, win.stops, strict=True))


def _sharded_cases(rank, world):
    return [_sharded_case(rank, world, spec) for spec in ("S0", "S1")]


@pytest.mark.parametrize("backend", backends(2))
def test_unmerge_on_dtensor_shards(backend):
    for cases in run_ranks(_sharded_cases, 2, backend=backend):
        for order, unchanged, exact, before, kept, errors, bounds in cases:
            assert "later kept merge" in order and unchanged  # refused on every rank
            assert exact and all(torch.equal(k, b) for k, b in zip(kept, before, strict=True))
            assert sorted(bounds) == ["0.weight", "2.weight"]
            assert all(0 < errors[n] <= bounds[n] < 0.05 for n in bounds), (errors, bounds)


def test_a_kept_merge_is_undone_after_the_storage_moved():
    # model.to(device) and pinning replace each parameter's .data: the same object, the same
    # values, nothing written, so the copy goes back where the parameter is now
    model = _model(torch.bfloat16)
    before = snapshot(model)
    report = shuttle.merge_lora(model, [(_lora(1), 1.0)], keep=True)
    for p in model.parameters():
        p.data = p.data.clone()
    assert shuttle.unmerge_lora(model, report).exact
    assert_unchanged(model, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_kept_merge_is_undone_after_moving_the_model_to_the_gpu():
    model = _model(torch.bfloat16)
    before = snapshot(model)
    report = shuttle.merge_lora(model, [(_lora(1), 1.0)], keep=True)
    model.to("cuda")
    assert shuttle.unmerge_lora(model, report).exact
    assert_unchanged(model.cpu(), before)


def test_a_kept_merge_inside_an_open_scoped_merge_is_refused():
    # the block's exit would discard it, and its copies (holding the block's merge) would then
    # bring the block's merge back for good
    model = _model(torch.bfloat16)
    before = snapshot(model)
    with shuttle.apply_lora(model, [(_lora(2), 1.0)]):
        inside = snapshot(model)
        with pytest.raises(ScopeOrderError, match="open apply_lora.*Merge after the block"):
            shuttle.merge_lora(model, [(_lora(1), 1.0)], keep=True)
        assert_unchanged(model, inside)
    assert_unchanged(model, before)
