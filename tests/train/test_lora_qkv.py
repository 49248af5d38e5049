"""lora_projections: q/k/v sharing one input, with LoRA on any of them, against autograd on
the unfused projections; an output nobody uses counts as zero; x is saved once."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import TrainingError
from shuttle.train import frozen_linear, lora_projections
from tests.train import factors, linear, lora_ref, rel_err, wide

TOL = {torch.float64: 1e-13, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("on", [(1, 1, 1), (1, 0, 1), (0, 1, 0)])
@pytest.mark.parametrize("used", [(1, 1, 1), (1, 1, 0)])
def test_matches_autograd_on_the_unfused_projections(dtype, on, used):
    outs, scales = (16, 8, 8), (0.5, 0.7, 0.9)
    layers = [linear(24, n, dtype, bias=i != 1) for i, n in enumerate(outs)]  # first and last
    facs = [factors(n, 24, 4, dtype) if o else (None, None) for n, o in zip(outs, on, strict=True)]
    x = torch.randn(2, 5, 24, dtype=dtype, requires_grad=True)
    ys = lora_projections(x, *[(frozen_linear(lyr), a, b, s)
                               for lyr, (a, b), s in zip(layers, facs, scales, strict=True)])
    dys = [torch.randn_like(y) for y in ys]
    sum((y * d).sum() for y, d, u in zip(ys, dys, used, strict=True) if u).backward()
    x64 = wide(x)
    f64 = [(wide(a), wide(b)) for a, b in facs]
    ys64 = [lora_ref(x64, lyr, a, b, s) for lyr, (a, b), s in zip(layers, f64, scales,
                                                                   strict=True)]
    sum((y * d.double()).sum() for y, d, u in zip(ys64, dys, used, strict=True) if u).backward()
    for y, y64 in zip(ys, ys64, strict=True):
        assert rel_err(y, y64) < TOL[dtype]
    assert rel_err(x.grad, x64.grad) < TOL[dtype]
    for (a, b), (a64, b64), u in zip(facs, f64, used, strict=True):
        if a is None:
            continue
        if u:
            assert rel_err(a.grad, a64.grad) < TOL[dtype]
            assert rel_err(b.grad, b64.grad) < TOL[dtype]
        else:  # an unused output: zero gradient (autograd gives none)
            assert a.grad is None or not a.grad.any()
            assert b.grad is None or not b.grad.any()


def test_the_input_is_saved_once():
    layers = [linear(24, 8) for _ in range(3)]
    facs = [factors(8, 24) for _ in range(3)]
    x = torch.randn(10, 24, dtype=torch.float64, requires_grad=True)
    ys = lora_projections(x, *[(frozen_linear(lyr), a, b, 1.0) for lyr, (a, b) in
                               zip(layers, facs, strict=True)])
    saved = [t for t in ys[0].grad_fn.saved_tensors if t is not None and t.shape == (10, 24)]
    assert len(saved) == 1


def test_float32_factors_on_a_bfloat16_input_get_float32_gradients():
    """PEFT's default: float32 adapters on a bf16 model (factors cast in one launch a call)."""
    outs, scales = (16, 8, 8), (0.5, 0.7, 0.9)
    layers = [linear(24, n, torch.bfloat16, bias=i == 1) for i, n in enumerate(outs)]
    facs = [factors(n, 24, r, torch.float32) if r else (None, None)
            for n, r in zip(outs, (4, 0, 2), strict=True)]
    x = torch.randn(7, 24, dtype=torch.bfloat16, requires_grad=True)
    ys = lora_projections(x, *[(frozen_linear(lyr), a, b, s)
                               for lyr, (a, b), s in zip(layers, facs, scales, strict=True)])
    dys = [torch.randn_like(y) for y in ys]
    torch.autograd.backward(ys, dys)
    x64 = wide(x)
    f64 = [(wide(a), wide(b)) for a, b in facs]
    ys64 = [lora_ref(x64, lyr, a, b, s)
            for lyr, (a, b), s in zip(layers, f64, scales, strict=True)]
    torch.autograd.backward(ys64, [d.double() for d in dys])
    assert all(y.dtype == torch.bfloat16 and rel_err(y, y64) < 2e-2
               for y, y64 in zip(ys, ys64, strict=True))
    assert rel_err(x.grad, x64.grad) < 2e-2
    for (a, b), (a64, b64) in zip(facs, f64, strict=True):
        if a is not None:
            assert a.grad.dtype == b.grad.dtype == torch.float32
            assert rel_err(a.grad, a64.grad) < 2e-2 and rel_err(b.grad, b64.grad) < 2e-2


@pytest.mark.parametrize("outs, first", [((16, 8, 12), [(10, 8), (10, 12)]),
                                         ((16, 16, 16), [(10, 16)])])
def test_the_narrower_projections_gemms_are_queued_first(outs, first):
    """The forward's first launches are base GEMMs (the GPU runs them while the host launches
    the adapters' small products): those of the projections narrower than the widest, whose
    expands, added after them, reread the least output (the first projection's where all are
    equally wide)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.name().startswith(("aten::mm", "aten::addmm", "aten::linear")):
                self.shapes.append(tuple(out.shape))
            return out

    layers = [linear(24, n) for n in outs]
    facs = [factors(n, 24) for n in outs]
    x = torch.randn(10, 24, dtype=torch.float64)
    with Products() as mode:
        ys = lora_projections(x, *[(frozen_linear(lyr), a, b, 0.5)
                                   for lyr, (a, b) in zip(layers, facs, strict=True)])
    assert mode.shapes[:len(first)] == first, mode.shapes
    for y, lyr, (a, b) in zip(ys, layers, facs, strict=True):
        torch.testing.assert_close(y, lora_ref(x, lyr, a, b, 0.5))


@pytest.mark.parametrize("changed", [0, 1, 2], ids=["q", "k", "v"])
@pytest.mark.parametrize("on", [(1, 1, 1), (1, 0, 0)], ids=["all", "q-only"])
def test_a_weight_changed_in_place_after_forward_raises_instead_of_a_wrong_gradient(changed,
                                                                                     on):
    outs = (16, 8, 12)
    layers = [linear(24, n) for n in outs]
    facs = [factors(n, 24) if o else (None, None) for n, o in zip(outs, on, strict=True)]
    x = torch.randn(3, 24, dtype=torch.float64, requires_grad=True)
    ys = lora_projections(x, *[(frozen_linear(lyr), a, b, 1.0)
                               for lyr, (a, b) in zip(layers, facs, strict=True)])
    with torch.no_grad():
        layers[changed].weight.mul_(2)
    with pytest.raises(TrainingError, match=rf"\({outs[changed]}, 24\) was changed in place"):
        sum(y.sum() for y in ys).backward()
