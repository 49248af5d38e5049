"""merge_lora into float8 weights: float32 math, one encoding, stochastic by default."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shuttle
from shuttle.apply.plan import plan_params
from shuttle.apply.rounding import merge_seed
from shuttle.weights import Fp8Weight
from tests.kernels.test_rounding import fp8_gap

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def model_and_lora(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential()
    model.layer = nn.Linear(16, 8, bias=False)
    with torch.no_grad():  # values exact in float8 and products exact in float32
        model.layer.weight.data = (torch.randint(-16, 17, (8, 16), generator=g) / 8).to(dtype)
    model.layer.weight.requires_grad_(False)
    a = torch.randint(-8, 9, (2, 16), generator=g) / 16
    b = torch.randint(-8, 9, (8, 2), generator=g) / 16
    return model, {"layer.lora_A.weight": a, "layer.lora_B.weight": b}


def delta(lora) -> torch.Tensor:
    return lora["layer.lora_B.weight"] @ lora["layer.lora_A.weight"]  # exact in float32


def reference(model, lora, strength):
    return model.layer.weight.double() + strength * delta(lora).double()


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", None])
def test_merge_within_a_step_of_float64(dtype, rounding):
    model, lora = model_and_lora(dtype)
    ref = reference(model, lora, 0.7)
    report = shuttle.merge_lora(model, [(lora, 0.7)], rounding=rounding)
    assert report.applied == ["layer.weight"]
    w = model.layer.weight
    assert w.dtype == dtype
    gap = fp8_gap(ref, dtype)
    err = (w.double() - ref).abs()
    assert (err <= (gap / 2 if rounding == "nearest" else gap) * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", FP8)
def test_default_is_stochastic_seeded_by_the_merges_arguments(dtype):
    model, lora = model_and_lora(dtype)
    w0 = model.layer.weight.detach().clone()
    exact = w0.float() + 0.7 * delta(lora)
    contribs = plan_params(dict(model.named_parameters()), [(lora, 0.7)]).params["layer.weight"]
    shuttle.merge_lora(model, [(lora, 0.7)], seed=5)
    g = torch.Generator().manual_seed(merge_seed("layer.weight", 5, contribs))
    want = Fp8Weight(w0).encode(exact, "stochastic", g).data
    assert torch.equal(model.layer.weight.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(want.float(), exact.to(dtype).float())  # differs from nearest


@pytest.mark.parametrize("dtype", FP8)
def test_a_merge_depends_only_on_its_arguments(dtype):
    """A second adapter merged after a first gives the bits it gives on a fresh copy of the
    first merge's result (as if saved and loaded again): no per-weight history."""
    model, lora = model_and_lora(dtype)
    other = {"layer.lora_A.weight": lora["layer.lora_A.weight"].flip(0),
             "layer.lora_B.weight": lora["layer.lora_B.weight"].flip(1) * 0.5}
    shuttle.merge_lora(model, [(lora, 0.7)])
    fresh, _ = model_and_lora(dtype)
    fresh.layer.weight.data = model.layer.weight.detach().clone()
    shuttle.merge_lora(model, [(other, 0.9)])
    shuttle.merge_lora(fresh, [(other, 0.9)])
    assert torch.equal(model.layer.weight.view(torch.uint8), fresh.layer.weight.view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
def test_different_adapters_draw_different_noise(dtype):
    model, lora = model_and_lora(dtype)
    other = {k: v.flip(0) for k, v in lora.items()}
    params = dict(model.named_parameters())
    seeds = {merge_seed("layer.weight", None, plan_params(params, [(sd, 1.0)]).params[
        "layer.weight"]) for sd in (lora, other)}
    seeds.add(merge_seed("layer.weight", None, plan_params(params, [(lora, 0.5)]).params[
        "layer.weight"]))
    assert len(seeds) == 3


def test_bfloat16_default_is_still_nearest():
    model, lora = model_and_lora(torch.bfloat16)
    ref = reference(model, lora, 0.3)
    shuttle.merge_lora(model, [(lora, 0.3)])
    assert torch.equal(model.layer.weight, ref.float().bfloat16())


def test_rounding_is_validated():
    model, lora = model_and_lora(torch.float8_e4m3fn)
    with pytest.raises(shuttle.errors.InvalidOptionError):
        shuttle.merge_lora(model, [(lora, 1.0)], rounding="down")
