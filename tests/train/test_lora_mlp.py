"""lora_mlp: SwiGLU / GeGLU MLPs with LoRA on any of the three projections, output and every
gradient against autograd on the unfused MLP (float64 tight, float32/bfloat16 within
tolerance), and what it saves for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shuttle.errors import TrainingError
from shuttle.train import frozen_linear, lora_mlp
from tests.train import factors, linear, lora_ref, rel_err, wide

ACTS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}
TOL = {torch.float64: 1e-13, torch.float32: 5e-6, torch.bfloat16: 3e-2}
K, FF, N, R = 24, 40, 24, 4


def _run(dtype, act, on, shape=(3, 5)):
    layers = [linear(K, FF, dtype, False), linear(K, FF, dtype, True), linear(FF, N, dtype, False)]
    facs = [factors(lyr.out_features, lyr.in_features, R, dtype) if o else (None, None)
            for lyr, o in zip(layers, on, strict=True)]
    scales = (0.5, 0.7, 0.9)
    x = torch.randn(*shape, K, dtype=dtype, requires_grad=True)
    dy = torch.randn(*shape, N, dtype=dtype)
    y = lora_mlp(x, act, *[(frozen_linear(lyr), a, b, s)
                           for lyr, (a, b), s in zip(layers, facs, scales, strict=True)])
    y.backward(dy)
    x64 = wide(x)
    f64 = [(wide(a), wide(b)) for a, b in facs]
    e = lora_ref(x64, layers[0], *f64[0], scales[0])
    g = lora_ref(x64, layers[1], *f64[1], scales[1])
    y64 = lora_ref(ACTS[act](e) * g, layers[2], *f64[2], scales[2])
    y64.backward(dy.double())
    pairs = [(y, y64), (x.grad, x64.grad)]
    for (a, b), (a64, b64) in zip(facs, f64, strict=True):
        if a is not None:
            pairs += [(a.grad, a64.grad), (b.grad, b64.grad)]
    return pairs, y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("on", [(1, 1, 1), (1, 0, 1), (0, 0, 1), (1, 1, 0)],
                         ids=["all", "gate+down", "down", "gate+up"])
def test_matches_autograd_on_the_unfused_mlp(dtype, act, on):
    pairs, _ = _run(dtype, act, on)
    for got, want in pairs:
        assert got.dtype == dtype and got.shape == want.shape
        assert rel_err(got, want) < TOL[dtype]


def test_saves_the_input_and_the_two_projections_only():
    layers = [linear(K, FF, bias=False), linear(K, FF), linear(FF, N, bias=False)]
    x = torch.randn(64, K, dtype=torch.float64, requires_grad=True)
    y = lora_mlp(x, "silu", *[(frozen_linear(lyr), *factors(lyr.out_features,
                                                            lyr.in_features), 1.0)
                              for lyr in layers])
    rows = sorted(tuple(t.shape) for t in y.grad_fn.saved_tensors
                  if t is not None and t.dim() == 2 and t.shape[0] == 64)
    # x (T, K), e and g (T, F), the rank-sized products; no (T, F) activation beyond e and g
    assert rows == [(64, 4), (64, 8), (64, K), (64, FF), (64, FF)]


@pytest.mark.parametrize("on", [(1, 1, 1), (0, 1, 1), (1, 0, 0)], ids=["all", "up+down", "gate"])
def test_float32_factors_on_a_bfloat16_input_get_float32_gradients(on):
    """PEFT's default: float32 adapters on a bf16 model (factors cast in one launch a call)."""
    layers = [linear(K, FF, torch.bfloat16, False), linear(K, FF, torch.bfloat16, True),
              linear(FF, N, torch.bfloat16, False)]
    facs = [factors(lyr.out_features, lyr.in_features, R, torch.float32) if o else (None, None)
            for lyr, o in zip(layers, on, strict=True)]
    scales = (0.5, 0.7, 0.9)
    x = torch.randn(9, K, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(9, N, dtype=torch.bfloat16)
    lora_mlp(x, "silu", *[(frozen_linear(lyr), a, b, s)
                          for lyr, (a, b), s in zip(layers, facs, scales, strict=True)]
             ).backward(dy)
    x64 = wide(x)
    f64 = [(wide(a), wide(b)) for a, b in facs]
    e = lora_ref(x64, layers[0], *f64[0], scales[0])
    g = lora_ref(x64, layers[1], *f64[1], scales[1])
    lora_ref(F.silu(e) * g, layers[2], *f64[2], scales[2]).backward(dy.double())
    assert rel_err(x.grad, x64.grad) < 3e-2
    for (a, b), (a64, b64) in zip(facs, f64, strict=True):
        if a is not None:
            assert a.grad.dtype == b.grad.dtype == torch.float32
            assert rel_err(a.grad, a64.grad) < 3e-2 and rel_err(b.grad, b64.grad) < 3e-2


@pytest.mark.parametrize("changed", [0, 1, 2], ids=["gate", "up", "down"])
def test_a_weight_changed_in_place_after_forward_raises_instead_of_a_wrong_gradient(changed):
    layers = [linear(K, FF, bias=False), linear(K, FF), linear(FF, N, bias=False)]
    x = torch.randn(3, K, dtype=torch.float64, requires_grad=True)
    y = lora_mlp(x, "silu", *[(frozen_linear(lyr), *factors(lyr.out_features,
                                                            lyr.in_features), 1.0)
                              for lyr in layers])
    with torch.no_grad():
        layers[changed].weight.mul_(2)
    shape = tuple(layers[changed].weight.shape)
    with pytest.raises(TrainingError, match=rf"\({shape[0]}, {shape[1]}\) was changed in place"):
        y.sum().backward()
