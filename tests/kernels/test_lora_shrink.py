"""The LoRA shrink kernel against its PyTorch reference and float64 math.

On CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest) with small blocks, so the odd
shapes span several tiles, K steps and rank tiles, with masked tails; on CUDA it is compiled.
"""

from __future__ import annotations

import pytest

from shuttle.kernels import lora_shrink, lora_shrink_reference, triton_available
from tests.kernels.test_lora_linear import (
    BF16,
    DTYPES,
    FP32,
    SHAPES,
    _assert_matches_float64,
    _assert_one_ulp,
    _layer,
)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


@pytest.mark.parametrize(("dtype", "fdtype"), DTYPES)
@pytest.mark.parametrize(("t", "k", "n", "r"), SHAPES)
def test_shrink_matches_reference_and_float64(t, k, n, r, dtype, fdtype):
    x, _, _, down, _, scale = _layer(t, k, n, r, dtype, fdtype)
    got = lora_shrink(x, down, scale)
    want = lora_shrink_reference(x, down, scale)
    assert got.dtype == (dtype if fdtype == dtype else FP32)
    _assert_one_ulp(got, want)
    _assert_matches_float64(got, (x.double() @ down.double().T) * scale.double())


def test_shrink_split_k_matches_reference():
    x, _, _, down, _, scale = _layer(7, 70, 8, 20, BF16, BF16)
    want = lora_shrink_reference(x, down, scale)
    for split in (2, 3, 9):  # 9 > the 5 K steps: clamped to one K step per split
        _assert_one_ulp(lora_shrink(x, down, scale, config=(16, 16, 16, 1, 1, split)), want)
