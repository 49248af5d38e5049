"""unmerge_lora: exactly from what merge_lora(keep=...) kept, or by subtraction within its
reported bound."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import ShapeMismatchError, ShuttleError, WideningError


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
    return model.to(dtype)


def _lora(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{i}.lora_{p}.weight": torch.randn(*s, generator=g) * 0.2
            for i, (o, n) in (("0", (48, 32)), ("2", (16, 48)))
            for p, s in (("A", (4, n)), ("B", (o, 4)))}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_a_kept_merge_is_undone_bit_for_bit(dtype):
    model = _model(torch.float32)
    if dtype == torch.float8_e4m3fn:  # float8 weights, float32 biases
        for layer in (model[0], model[2]):
            layer.weight.data = layer.weight.data.to(dtype)
    else:
        model = model.to(dtype)
    before = _state(model)
    report = shuttle.merge_lora(model, [(_lora(), 0.8)], keep=True)
    assert {k: v.device.type for k, v in report.kept.items()} == {
        "0.weight": "cpu", "2.weight": "cpu"}
    assert any(not torch.equal(v.float(), before[k].float()) for k, v in _state(model).items())
    undone = shuttle.unmerge_lora(model, report)
    assert undone.exact and undone.restored == ["0.weight", "2.weight"]
    for k, v in _state(model).items():
        assert torch.equal(v.view(torch.uint8), before[k].view(torch.uint8)), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_subtraction_lands_within_the_reported_bound(dtype):
    model = _model(dtype)
    before = _state(model)
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


def test_a_changed_parameter_is_refused_and_nothing_is_written():
    model = _model(torch.bfloat16)
    report = shuttle.merge_lora(model, [(_lora(), 1.0)], keep=True)
    model[2].weight = nn.Parameter(torch.zeros(16, 48, dtype=torch.float16))
    merged = _state(model)
    with pytest.raises(ShapeMismatchError, match="'2.weight' changed"):
        shuttle.unmerge_lora(model, report)
    for k, v in _state(model).items():
        assert torch.equal(v, merged[k]), k


def test_keep_on_a_widening_merge_is_refused_before_any_change():
    model = nn.Sequential()
    model.x_embedder = nn.Linear(4, 8)
    with pytest.raises((WideningError, ShuttleError)):
        shuttle.merge_lora(model, [({"x_embedder.lora_A.weight": torch.ones(2, 6),
                                     "x_embedder.lora_B.weight": torch.ones(8, 2)}, 1.0)],
                           keep=True)
    assert model.x_embedder.weight.shape == (8, 4)
