"""lora_linear: output and gradients against autograd on the unfused layer (float64 tight,
float32/bfloat16 within tolerance), dropout (gradcheck), 4-bit and float8 bases against
dequantize-then-autograd, and a weight overwritten between forward and backward."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import TrainingError
from shuttle.train import frozen_linear, lora_linear
from tests.train import factors, linear, lora_ref, rel_err, wide

TOL = {torch.float64: 1e-13, torch.float32: 2e-6, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_autograd_on_the_unfused_layer(dtype, bias):
    layer = linear(24, 16, dtype, bias)
    a, b = factors(16, 24, 4, dtype)
    x = torch.randn(2, 5, 24, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 5, 16, dtype=dtype)
    y = lora_linear(x, frozen_linear(layer), a, b, 0.7)
    y.backward(dy)
    x64, a64, b64 = wide(x), wide(a), wide(b)
    y64 = lora_ref(x64, layer, a64, b64, 0.7)
    y64.backward(dy.double())
    for got, want in [(y, y64), (x.grad, x64.grad), (a.grad, a64.grad), (b.grad, b64.grad)]:
        assert got.dtype == dtype and got.shape == want.shape
        assert rel_err(got, want) < TOL[dtype]


def test_float32_factors_on_a_bfloat16_base_get_float32_gradients():
    layer = linear(24, 16, torch.bfloat16)
    a, b = factors(16, 24, 4, torch.float32)
    x = torch.randn(6, 24, dtype=torch.bfloat16, requires_grad=True)
    y = lora_linear(x, frozen_linear(layer), a, b, 2.0)
    y.sum().backward()
    assert y.dtype == torch.bfloat16 and a.grad.dtype == b.grad.dtype == torch.float32
    x64, a64, b64 = wide(x), wide(a), wide(b)
    lora_ref(x64, layer, a64, b64, 2.0).sum().backward()
    assert rel_err(a.grad, a64.grad) < 2e-2 and rel_err(x.grad, x64.grad) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp16_factors_on_a_wider_input_never_narrow_it(dtype):
    """Inputs beyond fp16's range (3e5) with fp16 factors: the factors are cast to the input's
    dtype, never the input to theirs (right before this test too: pinned)."""
    layer = linear(24, 16, dtype)
    a, b = factors(16, 24, 4, torch.float16)
    x = (torch.randn(6, 24) * 3e5).to(dtype).requires_grad_()
    y = lora_linear(x, frozen_linear(layer), a, b, 0.5)
    y.sum().backward()
    x64, a64, b64 = wide(x), wide(a), wide(b)
    lora_ref(x64, layer, a64, b64, 0.5).sum().backward()
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert y.dtype == dtype and a.grad.dtype == torch.float16
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert rel_err(y, lora_ref(x64, layer, a64, b64, 0.5)) < tol
    assert rel_err(x.grad, x64.grad) < tol


def test_dropout_gradients_are_exact_and_the_mask_is_redrawn_not_saved():
    layer = linear(12, 8)
    a, b = factors(8, 12, 3)
    x = torch.randn(7, 12, dtype=torch.float64, requires_grad=True)

    def f(x, a, b):
        torch.manual_seed(3)  # the same mask for every evaluation gradcheck makes
        return lora_linear(x, frozen_linear(layer), a, b, 0.5, dropout=0.4)

    assert torch.autograd.gradcheck(f, (x, a, b))
    torch.manual_seed(3)
    y1 = f(x, a, b)
    torch.manual_seed(4)
    y2 = lora_linear(x, frozen_linear(layer), a, b, 0.5, dropout=0.4)
    assert not torch.equal(y1, y2)  # another seed, another mask
    saved = {t.data_ptr() for t in y1.grad_fn.saved_tensors}
    assert x.data_ptr() not in saved  # the dropped input is saved instead of x, never both


def test_a_weight_changed_in_place_after_forward_raises_instead_of_a_wrong_gradient():
    layer = linear(12, 8)
    a, b = factors(8, 12)
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    y = lora_linear(x, frozen_linear(layer), a, b, 1.0)
    with torch.no_grad():
        layer.weight.mul_(2)
    with pytest.raises(TrainingError, match=r"\(8, 12\) was changed in place"):
        y.sum().backward()


def test_float8_base_equals_autograd_on_its_upcast_weight():
    layer = linear(32, 16, torch.bfloat16, bias=False)
    w8 = layer.weight.to(torch.float8_e4m3fn)
    layer.weight = torch.nn.Parameter(w8, requires_grad=False)
    a, b = factors(16, 32, 4, torch.bfloat16)
    x = torch.randn(5, 32, dtype=torch.bfloat16, requires_grad=True)
    y = lora_linear(x, frozen_linear(layer), a, b, 0.5)
    y.sum().backward()
    ref_layer = linear(32, 16, torch.float64, bias=False)
    ref_layer.weight.data.copy_(w8.double())
    x64, a64, b64 = wide(x), wide(a), wide(b)
    lora_ref(x64, ref_layer, a64, b64, 0.5).sum().backward()
    assert rel_err(y, lora_ref(x64, ref_layer, a64, b64, 0.5)) < 2e-2
    assert rel_err(x.grad, x64.grad) < 2e-2 and rel_err(a.grad, a64.grad) < 2e-2


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_base_equals_autograd_on_its_dequantized_weight(quant_type):
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(64, 32, bias=True, quant_type=quant_type,
                              compute_dtype=torch.float32)
    layer.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False,
                                     quant_type=quant_type)
    layer = layer.to("cuda" if torch.cuda.is_available() else "cpu")
    layer.requires_grad_(False)
    dev = layer.weight.device
    dense = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    a, b = factors(32, 64, 4, torch.float32, device=dev)
    x = torch.randn(6, 64, device=dev, requires_grad=True)
    base = frozen_linear(layer)
    assert base.kind == "4bit"
    y = lora_linear(x, base, a, b, 0.5)
    y.sum().backward()
    ref = linear(64, 32, torch.float64, device=dev)
    ref.weight.data.copy_(dense.double())
    ref.bias.data.copy_(layer.bias.double())
    x64, a64, b64 = wide(x), wide(a), wide(b)
    y64 = lora_ref(x64, ref, a64, b64, 0.5)
    y64.sum().backward()
    assert rel_err(y, y64) < 1e-5 and rel_err(x.grad, x64.grad) < 1e-5
    assert rel_err(a.grad, a64.grad) < 1e-5 and rel_err(b.grad, b64.grad) < 1e-5
