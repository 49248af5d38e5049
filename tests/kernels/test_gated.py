"""The gated activation kernels against their PyTorch references (interpreter on CPU), and
the references against autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shuttle.kernels.gated import (
    ACTIVATIONS,
    gated_backward,
    gated_backward_reference,
    gated_forward,
    gated_forward_reference,
)

AUTOGRAD = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
            "gelu": F.gelu}


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_reference_backward_is_autograd(act):
    e = (torch.randn(300, dtype=torch.float64) * 3).requires_grad_()
    g = torch.randn(300, dtype=torch.float64).requires_grad_()
    dh = torch.randn(300, dtype=torch.float64)
    (AUTOGRAD[act](e) * g).backward(dh)
    h, de, dg = gated_backward_reference(dh, e.detach(), g.detach(), act)
    torch.testing.assert_close(h, AUTOGRAD[act](e) * g, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(de, e.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dg, g.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_kernels_match_the_references(act, dtype, in_place):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    e = (torch.randn(5, 777, device=dev) * 3).to(dtype)
    g, dh = (torch.randn(5, 777, device=dev).to(dtype) for _ in range(2))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(gated_forward(e, g, act), gated_forward_reference(e, g, act), **tol)
    want = gated_backward_reference(dh, e, g, act)
    bufs = (dh.clone(), e.clone(), g.clone())
    got = gated_backward(*bufs, act, in_place=in_place)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tol)
    if in_place:
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(got, bufs, strict=True))


def test_unknown_activation_is_a_value_error():
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="silu"):
        gated_forward(t, t, "relu")
