"""optimum-quanto qint8/qfloat8 weights against quanto's own quantization."""

from __future__ import annotations

import pytest
import torch

from shuttle.weights import QuantoWeight, represent

quanto = pytest.importorskip("optimum.quanto")


def frozen(qtype, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 8, bias=False)).to(dtype)
    w = m[0].weight.detach().float().clone()
    quanto.quantize(m, weights=qtype)
    quanto.freeze(m)
    return m, w


@pytest.mark.parametrize("qtype", ["qint8", "qfloat8"])
def test_dequantize_and_nearest_encode_are_quanto_own(qtype):
    m, w = frozen(getattr(quanto, qtype))
    rep = represent(m[0].weight)
    assert isinstance(rep, QuantoWeight) and rep.logical_shape == (8, 64)
    assert torch.equal(rep.dequantize(), m[0].weight.dequantize())
    enc = rep.encode(w)
    assert torch.equal(enc.data.float(), rep.data.float()) and torch.equal(enc.scale, rep.scale)


@pytest.mark.parametrize("qtype", ["qint8", "qfloat8"])
def test_stochastic_is_unbiased_repeatable_and_written_in_place(qtype):
    m, w = frozen(getattr(quanto, qtype))
    rep = represent(m[0].weight)
    x = w[:2].contiguous()
    small = QuantoWeight(rep.data[:2].clone(), rep.scale[:2].clone(), rep.compute)
    n = 400
    draws = [small.encode(x, "stochastic", torch.Generator().manual_seed(s)) for s in range(n)]
    mean = sum(d.dequantize() for d in draws) / n
    nearest_err = (small.encode(x).dequantize() - x).abs().mean()
    assert (mean - x).abs().mean() < 0.5 * nearest_err
    assert torch.equal(draws[3].data.float(), small.encode(
        x, "stochastic", torch.Generator().manual_seed(3)).data.float())
    ptr = rep.data.data_ptr()
    new = rep.encode(w * 2)
    new.write_into(m[0].weight)
    assert m[0].weight._data.data_ptr() == ptr
    x_in = torch.randn(3, 64)
    torch.testing.assert_close(m(x_in), x_in @ new.dequantize().T)
    assert type(rep.to("cpu")) is QuantoWeight
