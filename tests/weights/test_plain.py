"""PlainWeight: float tensors, rounded once like shuttle.apply.rounding."""

from __future__ import annotations

import pytest
import torch

from shuttle.apply.rounding import param_seed, round_to
from shuttle.weights import PlainWeight, represent


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_and_rounding_like_round_to(dtype):
    x = torch.randn(32, 16, dtype=torch.float64).float()
    rep = represent(torch.zeros(32, 16, dtype=dtype))
    assert isinstance(rep, PlainWeight)
    assert rep.logical_shape == (32, 16) and rep.compute_dtype == dtype
    near = rep.encode(x)
    assert torch.equal(near.data, x.to(dtype))
    assert torch.equal(near.dequantize(), x.to(dtype).float())
    g = torch.Generator().manual_seed(param_seed("w", 3))
    sto = rep.encode(x, "stochastic", g)
    assert torch.equal(sto.data.float(), round_to(x, dtype, "stochastic", "w", 3).float())


def test_bf16_stochastic_error_within_a_step():
    x = torch.randn(1000)
    out = PlainWeight(x.bfloat16()).encode(x, "stochastic", torch.Generator().manual_seed(0))
    step = x.abs() * 2.0**-7  # bfloat16 has 8 significand bits
    assert ((out.dequantize() - x).abs() <= step).all()


def test_to_pin_and_nbytes():
    rep = PlainWeight(torch.randn(4, 4, dtype=torch.bfloat16))
    assert rep.nbytes == 32
    assert isinstance(rep.pin(), PlainWeight)
    moved = rep.to("cpu")
    assert isinstance(moved, PlainWeight) and torch.equal(moved.data, rep.data)
