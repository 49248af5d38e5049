"""Fp8Weight: dequantize, re-encode with recomputed scales, float64 reference, rounding modes."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import ShuttleError
from shuttle.weights import Fp8Weight, represent
from tests.kernels.test_rounding import fp8_gap

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def weight(dtype: torch.dtype, rows: int = 16, cols: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, so a per-row scale matters
    return torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("granularity", ["none", "tensor", "row"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_encode_then_dequantize_within_a_step(dtype, granularity, rounding):
    x = weight(dtype)
    if dtype == torch.float8_e4m3fn and granularity == "none":
        x = x.clamp(-448, 448)
    scale = {"none": None, "tensor": torch.tensor(1.0),
             "row": torch.ones(x.shape[0])}[granularity]
    template = Fp8Weight(torch.zeros(x.shape, dtype=dtype), scale)
    enc = template.encode(x, rounding, torch.Generator().manual_seed(0))
    assert isinstance(enc, Fp8Weight) and enc.data.dtype == dtype
    assert enc.logical_shape == x.shape
    s = torch.ones(()) if enc.scale is None else enc.scale
    assert s.shape == (() if scale is None else scale.shape)
    if granularity != "none":  # scale recomputed: the largest magnitude lands on finfo.max
        amax = x.abs().amax() if granularity == "tensor" else x.abs().amax(dim=1)
        torch.testing.assert_close(enc.scale, amax / torch.finfo(dtype).max)
    s_b = s.double().reshape(-1, 1) if s.dim() else s.double()
    gap = fp8_gap(x.double() / s_b, dtype) * s_b
    err = (enc.dequantize().double() - x.double()).abs()
    bound = gap / 2 if rounding == "nearest" else gap
    assert (err <= bound * (1 + 1e-6)).all()
    assert torch.equal(enc.dequantize(), enc.dequantize())  # dequantize is pure


@pytest.mark.parametrize("dtype", FP8)
def test_dequantize_is_data_times_scale(dtype):
    data = torch.randn(4, 3, 2).to(dtype)
    row = torch.tensor([1.0, 2.0, 0.5, 4.0])
    assert torch.equal(Fp8Weight(data).dequantize(), data.float())
    assert torch.equal(Fp8Weight(data, torch.tensor(3.0)).dequantize(), data.float() * 3)
    assert torch.equal(Fp8Weight(data, row).dequantize(), data.float() * row.view(4, 1, 1))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_unscaled_encode_clamps_to_the_finite_range(dtype, rounding):
    fmax = torch.finfo(dtype).max
    x = torch.tensor([1e9, -1e9, fmax * 1.01, 0.0])
    enc = Fp8Weight(torch.zeros(4, dtype=dtype)).encode(x, rounding)
    assert enc.dequantize().tolist() == [fmax, -fmax, fmax, 0.0]


def test_all_zero_rows_keep_scale_one():
    x = torch.zeros(3, 4)
    x[1] = 2.0
    enc = Fp8Weight(torch.zeros(3, 4, dtype=torch.float8_e4m3fn), torch.ones(3)).encode(x)
    assert enc.scale[0] == 1 and enc.scale[2] == 1
    assert torch.equal(enc.dequantize(), x)


def test_bad_inputs_raise():
    with pytest.raises(ShuttleError, match="float8"):
        Fp8Weight(torch.zeros(2, 2))
    with pytest.raises(ShuttleError, match="scale"):
        Fp8Weight(torch.zeros(2, 2, dtype=torch.float8_e5m2), torch.ones(3))


def test_representation_keeps_form_through_to_and_pin():
    rep = represent(torch.randn(8, 4).to(torch.float8_e4m3fn))
    assert isinstance(rep, Fp8Weight) and rep.scale is None
    scaled = Fp8Weight(rep.data, torch.ones(8))
    assert scaled.nbytes == 8 * 4 + 8 * 4
    for moved in (scaled.to("cpu"), scaled.to("cpu", non_blocking=True), scaled.pin()):
        assert isinstance(moved, Fp8Weight)
        assert moved.data.dtype == torch.float8_e4m3fn and moved.scale.dtype == torch.float32
        assert torch.equal(moved.dequantize(), scaled.dequantize())
    assert scaled.to("meta").device.type == "meta"
    assert scaled.compute_dtype == torch.bfloat16


def test_write_into_copies_unscaled_values_and_refuses_a_scale():
    p = torch.zeros(3, 4, dtype=torch.float8_e4m3fn)
    values = torch.randn(3, 4).to(torch.float8_e4m3fn)
    Fp8Weight(values).write_into(p)
    assert torch.equal(p.view(torch.uint8), values.view(torch.uint8))
    with pytest.raises(ShuttleError, match="scale"):
        Fp8Weight(values, torch.ones(3)).write_into(p)
