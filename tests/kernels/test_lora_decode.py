"""The one-launch decode update against its PyTorch reference and float64 math.

On CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest); on CUDA it is compiled.
"""

from __future__ import annotations

import pytest
import torch

from shuttle.kernels import triton_available
from shuttle.kernels.lora_decode import lora_decode_add, lora_decode_add_reference
from tests.kernels.test_lora_linear import _assert_one_ulp

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(t, k, n, r, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(t, n, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(t, k, generator=g).to(dtype).to(DEVICE)
    down = (torch.randn(r, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    up = (torch.randn(n, r, generator=g) * 0.3).to(dtype).to(DEVICE)
    scale = (0.25 + torch.rand(r, generator=g)).to(DEVICE)
    return out, x, down, up, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("t", "k", "n", "r"), [(1, 40, 100, 3), (16, 70, 130, 20), (64, 32, 64, 16)]
)
def test_matches_reference_and_float64(t, k, n, r, dtype):
    out, x, down, up, scale = _case(t, k, n, r, dtype)
    got = lora_decode_add(out.clone(), x, down, up, scale)
    want = lora_decode_add_reference(out.clone(), x, down, up, scale)
    _assert_one_ulp(got, want)  # float32 summation order may differ from the reference's
    exact = out.double() + ((x.double() @ down.double().T) * scale.double()) @ up.double().T
    assert int((got != exact.to(dtype)).sum()) <= max(4, got.numel() // 100)


def test_in_place_on_a_row_strided_view():
    out, x, down, up, scale = _case(5, 48, 80, 8, torch.bfloat16)
    buf = torch.zeros(5, 100, dtype=torch.bfloat16, device=DEVICE)
    buf[:, 10:90] = out
    view = buf[:, 10:90]
    assert lora_decode_add(view, x, down, up, scale) is view
    want = lora_decode_add_reference(out.clone(), x, down, up, scale)
    assert int((buf[:, 10:90] != want).sum()) <= 4
    assert not buf[:, :10].any() and not buf[:, 90:].any()


def test_bad_shapes_and_too_many_rows():
    out, x, down, up, scale = _case(4, 32, 48, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="expected"):
        lora_decode_add(out, x, down[:, :16], up, scale)
    big = _case(65, 32, 48, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="at most 64 rows"):
        lora_decode_add(*big)


def test_float32_falls_back_to_the_reference():
    out, x, down, up, scale = _case(4, 32, 48, 8, torch.float32)
    got = lora_decode_add(out.clone(), x, down, up, scale)
    assert torch.equal(got, lora_decode_add_reference(out.clone(), x, down, up, scale))
