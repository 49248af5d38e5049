"""The fused LoRA linear kernel, fed by the shrink, against PyTorch references and float64 math.

The shrink alone is tested in test_lora_shrink.py, the Hopper (TMA) kernel in
test_lora_linear_tma.py; their shapes, dtypes and checks are defined here.

On CPU the kernels run under TRITON_INTERPRET=1 (set in conftest) with small blocks, so the odd
shapes below span several tiles, K steps and rank steps, with masked tails; on CUDA they are
compiled (the ``gpu`` test uses the H200 defaults at larger shapes).
"""

from __future__ import annotations

import pytest
import torch

from shuttle.kernels import (
    lora_linear_fused,
    lora_linear_fused_reference,
    lora_shrink,
    lora_shrink_reference,
    triton_available,
)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (T, K, N, R): T=1 is decode; K=32 is a multiple of the interpreter's K step (unmasked loads).
SHAPES = [(1, 24, 33, 1), (7, 70, 96, 5), (50, 70, 33, 20), (7, 32, 96, 20)]
# (activation dtype, LoRA factor dtype)
DTYPES = [(BF16, BF16), (BF16, FP32), (FP16, FP16), (FP16, FP32)]


def _layer(t, k, n, r, dtype, fdtype, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    bias = (torch.randn(n, generator=g) * 0.5).to(dtype).to(device)
    down = (torch.randn(r, k, generator=g) / k**0.5).to(fdtype).to(device)
    up = (torch.randn(n, r, generator=g) * 0.2).to(fdtype).to(device)
    scale = (0.25 + torch.rand(r, generator=g)).to(device)  # per rank, float32
    return x, w, bias, down, up, scale


def _assert_one_ulp(got, want, rel_atol=1e-5):
    """Equal, except one ulp on a few elements (float32 summation order may differ).

    ``rel_atol`` (relative to the largest value) covers results that nearly cancel, whose ulp is
    smaller than the float32 accumulation's own error.
    """
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == FP32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    diff = (got.double() - want.double()).abs()
    # the larger of the gaps to both neighbours: one ulp either way, also at powers of two
    ulp = torch.maximum(*((torch.nextafter(want, torch.full_like(want, inf)).double()
                           - want.double()).abs() for inf in (torch.inf, -torch.inf)))
    atol = rel_atol * float(want.double().abs().max())
    assert bool((diff <= torch.clamp(ulp, min=atol)).all()), float(diff.max())
    assert int((got != want).sum()) <= max(4, got.numel() // 100)


def _assert_matches_float64(got, exact):
    """``got`` is ``exact`` (float64) rounded once, up to the float32 accumulation's error."""
    if got.dtype == FP32:
        scale = float(exact.abs().max())
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6 * scale)
    else:
        _assert_one_ulp(got, exact.to(got.dtype))


@pytest.mark.parametrize(("dtype", "fdtype"), DTYPES)
@pytest.mark.parametrize(("t", "k", "n", "r"), SHAPES)
def test_fused_matches_reference_and_float64(t, k, n, r, dtype, fdtype):
    x, w, bias, down, up, scale = _layer(t, k, n, r, dtype, fdtype)
    s = lora_shrink_reference(x, down, scale)  # what the layer feeds the fused kernel
    for b in (bias, None):
        got = lora_linear_fused(x, w, b, s, up)
        want = lora_linear_fused_reference(x, w, b, s, up)
        assert got.dtype == dtype
        _assert_one_ulp(got, want)
        exact = x.double() @ w.double().T + s.double() @ up.double().T
        if b is not None:
            exact += b.double()
        _assert_matches_float64(got, exact)


@pytest.mark.parametrize(("dtype", "fdtype"), [(BF16, BF16), (BF16, FP32), (FP16, FP16)])
def test_layer_close_to_float64_math(dtype, fdtype):
    """Shrink then fused, against the whole layer in float64 with unrounded intermediates."""
    x, w, bias, down, up, scale = _layer(50, 70, 96, 20, dtype, fdtype)
    out = lora_linear_fused(x, w, bias, lora_shrink(x, down, scale), up)
    xd = x.double()
    exact = xd @ w.double().T + ((xd @ down.double().T) * scale.double()) @ up.double().T
    exact += bias.double()
    rel = float((out.double() - exact).norm() / exact.norm())
    # bf16/fp16 outputs: about half an ulp of rounding; float32 factors add no error of their own
    assert rel < (4e-3 if dtype == BF16 else 5e-4), rel


def test_non_contiguous_inputs():
    x, w, bias, down, up, scale = _layer(9, 40, 33, 6, BF16, BF16)
    buf = torch.zeros(9, 80, dtype=BF16, device=DEVICE)
    buf[:, 5:45] = x
    x_view = buf[:, 5:45]  # row stride 80, offset 5, unit column stride: used as it is
    w_t = w.T.contiguous().T  # column-major: copied
    up_t = up.T.contiguous().T
    s = lora_shrink(x_view, down.T.contiguous().T, scale)
    _assert_one_ulp(s, lora_shrink_reference(x, down, scale))
    _assert_one_ulp(lora_linear_fused(x_view, w_t, bias, s, up_t),
                    lora_linear_fused_reference(x, w, bias, s, up))


def test_rank_above_one_step_and_custom_config():
    # R=40 with 16-rank steps: three steps, the last masked; a 16 x 16 tile config.
    x, w, bias, down, up, scale = _layer(20, 24, 40, 40, FP16, FP16)
    s = lora_shrink(x, down, scale)
    got = lora_linear_fused(x, w, bias, s, up, config=(16, 16, 16, 16, 1, 1, 1))
    _assert_one_ulp(got, lora_linear_fused_reference(x, w, bias, s, up))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_cpu_without_interpreter_falls_back_to_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, bias, down, up, scale = _layer(5, 24, 16, 3, BF16, BF16)
    s = lora_shrink(x, down, scale)
    assert torch.equal(s, lora_shrink_reference(x, down, scale))
    assert torch.equal(lora_linear_fused(x, w, bias, s, up),
                       lora_linear_fused_reference(x, w, bias, s, up))


def test_autograd_uses_the_differentiable_reference():
    x, w, bias, down, up, scale = _layer(5, 24, 16, 3, FP32, FP32)
    down.requires_grad_(True)
    up.requires_grad_(True)
    out = lora_linear_fused(x, w, bias, lora_shrink(x, down, scale), up)
    out.sum().backward()
    assert down.grad is not None and up.grad is not None


def test_shape_errors():
    x, w, bias, down, up, scale = _layer(5, 24, 16, 3, BF16, BF16)
    with pytest.raises(ValueError):
        lora_shrink(x, down[:, :10], scale)
    with pytest.raises(ValueError):
        lora_linear_fused(x, w, bias, torch.zeros(5, 4, dtype=BF16, device=DEVICE), up)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "fdtype"), [(BF16, BF16), (BF16, FP32), (FP16, FP16)])
@pytest.mark.parametrize("t", [1, 16, 777])
def test_gpu_kernels_match_reference(t, dtype, fdtype):
    # K and N are not multiples of the block sizes; the default H200 configs are used.
    k, n, r = 1000, 3000, 48
    x, w, bias, down, up, scale = _layer(t, k, n, r, dtype, fdtype, device="cuda")
    s = lora_shrink(x, down, scale)
    _assert_one_ulp(s, lora_shrink_reference(x, down, scale))
    out = lora_linear_fused(x, w, bias, s, up)
    _assert_one_ulp(out, lora_linear_fused_reference(x, w, bias, s, up))
    exact = x.double() @ w.double().T + s.double() @ up.double().T + bias.double()
    _assert_matches_float64(out, exact)
