"""The float8 upcast kernel against ``Tensor.to`` (under the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from shuttle.kernels.upcast import upcast


def every_code(dtype: torch.dtype, finite: bool = False) -> torch.Tensor:
    """All 256 bit patterns of a float8 dtype (or its finite ones), odd length."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    if finite:
        codes = codes[codes.float().isfinite()]
    return torch.cat([codes, codes[:77]])


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_finite_code_converts_exactly(fp8, out):
    # Triton's interpreter decodes NaN/inf codes as finite numbers; the GPU test below covers
    # them (the hardware conversion keeps them).
    x = every_code(fp8, finite=not torch.cuda.is_available())
    got, want = upcast(x, out), x.to(out)
    assert got.dtype == out and got.shape == x.shape
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.all()


def test_shapes_and_other_inputs():
    x = (torch.randn(3, 5000) * 10).to(torch.float8_e4m3fn)
    assert torch.equal(upcast(x, torch.bfloat16), x.to(torch.bfloat16))
    t = x.t()  # not contiguous: the plain cast
    assert torch.equal(upcast(t, torch.bfloat16), t.to(torch.bfloat16))
    y = torch.randn(4, 4)
    assert torch.equal(upcast(y, torch.bfloat16), y.to(torch.bfloat16))


@pytest.mark.gpu
def test_cuda_matches_the_cast_on_every_code():
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = torch.cat([(torch.randn(1000, 301, device="cuda") * 30).to(fp8).view(-1),
                       every_code(fp8).cuda()])
        for out in (torch.bfloat16, torch.float16, torch.float32):
            got, want = upcast(x, out), x.to(out)
            assert ((got == want) | (got.isnan() & want.isnan())).all()
