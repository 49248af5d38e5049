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


def test_short_inputs_take_the_pointer_kernel_where_the_tma_kernel_would_run(monkeypatch):
    """On Hopper an x of at most 8192 rows and 4096 features takes SHRINK_SHORT_CONFIG (the TMA
    kernel's start is a large share of such a call); longer or wider ones the TMA kernel;
    ``tma`` and ``config`` given are kept."""
    import importlib

    import torch

    from shuttle.kernels.lora_linear_tma import SHRINK_TMA_CONFIG

    mod = importlib.import_module("shuttle.kernels.lora_shrink")  # the package exports a function

    calls = []
    monkeypatch.setattr(mod, "interpreting", lambda: False)
    monkeypatch.setattr(mod, "use_kernel", lambda *args: True)
    monkeypatch.setattr(mod, "tma_addressable", lambda *args: True)
    monkeypatch.setattr(mod, "_launch", lambda x, down, scale, out, cfg, *rest:
                        calls.append(("pointer", cfg)))
    monkeypatch.setattr(mod, "linear_tma", lambda *args: calls.append(("tma", args[-1])))

    def kernel(t, k, **kwargs):
        x, down = torch.empty(t, k, dtype=BF16), torch.empty(64, k, dtype=BF16)
        mod.lora_shrink(x, down, torch.ones(64), **kwargs)
        return calls[-1]

    assert mod.short_shrink(8192, 4096) and not mod.short_shrink(8193, 64)
    assert not mod.short_shrink(64, 4104)
    assert kernel(4096, 1536) == ("pointer", mod.SHRINK_SHORT_CONFIG)
    assert kernel(8192, 4096) == ("pointer", mod.SHRINK_SHORT_CONFIG)
    assert kernel(4096, 6144) == ("tma", SHRINK_TMA_CONFIG)
    assert kernel(8200, 1536) == ("tma", SHRINK_TMA_CONFIG)
    assert kernel(4096, 1536, tma=True) == ("tma", SHRINK_TMA_CONFIG)
    assert kernel(4096, 1536, tma=False) == ("pointer", mod.SHRINK_CUDA_CONFIG)
    assert kernel(4096, 1536, config=(32, 64, 64, 4, 2, 1)) == ("pointer", (32, 64, 64, 4, 2, 1))


def test_the_short_launch_matches_reference():
    """launch_short_shrink (the prepared Hopper layer's short shrink) writes what lora_shrink
    would (here under the interpreter, its configuration's blocks over partial tiles)."""
    import torch

    from shuttle.kernels.lora_shrink import launch_short_shrink

    x, _, _, down, _, scale = _layer(70, 200, 8, 24, BF16, BF16)
    out = torch.full((70, 24), float("nan"), dtype=BF16)
    launch_short_shrink(x, down, scale, out)
    _assert_one_ulp(out, lora_shrink_reference(x, down, scale))
