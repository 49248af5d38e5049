"""torchao Float8Tensor / Int8Tensor weights (CPU); the int4 tile-packed one needs CUDA."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import UnmergeableWeightError
from shuttle.weights import TorchaoInt4Weight, TorchaoScaledWeight, represent

q = pytest.importorskip("torchao.quantization")


def tensors(seed=0):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(seed))
    return {
        "f8_row": q.Float8Tensor.from_hp(w, granularity=q.PerRow()),
        "f8_tensor": q.Float8Tensor.from_hp(w, granularity=q.PerTensor()),
        "int8_row": q.Int8Tensor.from_hp(w, granularity=q.PerRow()),
    }, w


@pytest.mark.parametrize("kind", ["f8_row", "f8_tensor", "int8_row"])
def test_dequantize_is_torchao_own_and_encode_keeps_the_form(kind):
    ts, w = tensors()
    t = ts[kind]
    rep = represent(t)
    assert isinstance(rep, TorchaoScaledWeight) and rep.logical_shape == (16, 128)
    assert torch.equal(rep.dequantize(), t.dequantize().float())
    for rounding in ("nearest", "stochastic"):
        enc = rep.encode(w * 3, rounding, torch.Generator().manual_seed(0))
        assert enc.qdata.dtype == rep.qdata.dtype and enc.scale.shape == rep.scale.shape
        rel = (enc.dequantize() - w * 3).abs() / (w * 3).abs().amax()
        assert rel.max() < (0.07 if kind.startswith("f8") else 0.01)
    new = rep.encode(w * 3)
    new.write_into(t)
    assert torch.equal(t.dequantize().float(), new.dequantize())


def test_stochastic_int8_is_unbiased():
    ts, w = tensors()
    rep = represent(ts["int8_row"])
    n = 300
    mean = sum(rep.encode(w, "stochastic", torch.Generator().manual_seed(s)).dequantize()
               for s in range(n)) / n
    assert ((mean - w).abs() <= 4 * rep.scale / (2 * n ** 0.5)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="int4 tile packing needs CUDA")
def test_int4_tile_packed_is_not_mergeable():
    w = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    t = q.Int4TilePackedTo4dTensor.from_hp(w, [1, 128])
    rep = represent(t)
    assert isinstance(rep, TorchaoInt4Weight) and not rep.mergeable
    dq = rep.dequantize()
    assert dq.shape == (64, 256) and dq.dtype == torch.float32
    # The weight the layer computes with: its linear equals a plain matmul with it ...
    x = torch.randn(8, 256, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(torch.nn.functional.linear(x, t).float(),
                               x.float() @ dq.T, rtol=2e-2, atol=2e-2)
    # ... and it is the original weight up to int4 rounding (16 levels per group of 128).
    assert (dq - w.float()).pow(2).mean().sqrt() < 0.2 * w.float().pow(2).mean().sqrt()
    with pytest.raises(UnmergeableWeightError, match="dynamic"):
        rep.encode(rep.dequantize())
