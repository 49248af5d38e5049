"""ScaledCodes: a representation of the codes-times-scale form declares its fields and gets
dequantize, encode (absmax_encode) and the fused merge."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shuttle.kernels import triton_available
from shuttle.weights import ScaledCodes, absmax_encode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass
class RowCodes(ScaledCodes):
    """A user's own form: codes under another field name, one scale per row."""

    codes: torch.Tensor
    scale: torch.Tensor
    compute: torch.dtype = torch.bfloat16

    tensor_names = ("codes", "scale")
    shape_field = "codes"


def _weight(dtype: torch.dtype) -> tuple[RowCodes, torch.Tensor]:
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    codes, scale = absmax_encode(x, dtype, torch.ones(24, 1, device=DEVICE))
    return RowCodes(codes, scale), x


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_declared_fields_give_dequantize_and_encode(dtype):
    w, x = _weight(dtype)
    assert w.logical_shape == (24, 32) and w.compute_dtype == torch.bfloat16
    assert torch.equal(w.dequantize(), w.codes.float() * w.scale)
    again = w.encode(w.dequantize())
    assert type(again) is RowCodes and again.codes.dtype == dtype
    assert again.scale.shape == (24, 1)
    step = w.scale if dtype == torch.int8 else w.scale * 32  # e4m3: 3 mantissa bits
    assert bool(((w.dequantize() - x).abs() <= step / 2 + 1e-6).all())


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_merge_lowrank_is_encode_of_the_merged_weight():
    w, _ = _weight(torch.int8)
    g = torch.Generator().manual_seed(1)
    up = (torch.randn(24, 4, generator=g) * 0.1).bfloat16().to(DEVICE)
    down = (torch.randn(4, 32, generator=g) * 0.1).bfloat16().to(DEVICE)
    got = w.merge_lowrank(up, down, [0, 4], [0.5])
    want = w.encode(w.dequantize() + 0.5 * (up.float() @ down.float()))
    assert type(got) is RowCodes
    torch.testing.assert_close(got.scale, want.scale, rtol=4e-7, atol=0)
    d = (got.codes.long() - want.codes.long()).abs()
    assert int(d.max()) <= 1 and int((d > 0).sum()) <= 3  # float32 summation order only
