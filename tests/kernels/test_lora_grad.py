"""The LoRA backward's rank-sized products for several projections in one launch: the kernels
against their PyTorch references (interpreter on CPU), the references against float64 math."""

from __future__ import annotations

import pytest
import torch

from shuttle.kernels.lora_grad import (
    lora_grad_b,
    lora_grad_b_reference,
    lora_grad_u,
    lora_grad_u_reference,
    takes_lora_grads,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(t, widths, ranks, factor_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    dys = [torch.randn(t, n, generator=g).to(DEVICE, torch.bfloat16) for n in widths]
    bs = [torch.randn(n, r, generator=g).to(DEVICE, factor_dtype)
          for n, r in zip(widths, ranks, strict=True)]
    hx = torch.randn(t, sum(ranks), generator=g).to(DEVICE, torch.bfloat16)
    scales = [0.5, 2.0, 1.25][:len(widths)]
    return dys, bs, hx, scales


def test_the_references_are_the_math():
    dys, bs, hx, scales = _case(9, [7, 5], [3, 2], torch.float32)
    u = lora_grad_u_reference(dys, bs, scales, torch.full((9, 5), 9.0, dtype=torch.bfloat16,
                                                           device=DEVICE))
    gb = lora_grad_b_reference(dys, hx, scales, [3, 2], torch.float32)
    at = 0
    for dy, b, s, g in zip(dys, bs, scales, gb, strict=True):
        r = b.shape[1]
        want_u = s * dy.double() @ b.to(torch.bfloat16).double()
        torch.testing.assert_close(u[:, at:at + r].double(), want_u, rtol=1e-2, atol=1e-2)
        want_b = s * dy.double().T @ hx[:, at:at + r].double()
        torch.testing.assert_close(g.double(), want_b, rtol=1e-5, atol=1e-5)
        at += r


@pytest.mark.parametrize(("t", "widths", "ranks"), [
    (70, [40, 24, 24], [16, 8, 1]),    # three projections, ranks of all kinds, ragged T
    (33, [36, 20], [4, 4]),            # rows not on 16 bytes (36 bf16 = 72 bytes)
    (64, [48], [16]),                  # one projection
])
@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_match_the_references(t, widths, ranks, factor_dtype):
    dys, bs, hx, scales = _case(t, widths, ranks, factor_dtype)
    assert takes_lora_grads(dys, bs)
    u = torch.full((t, sum(ranks)), 7.0, dtype=torch.bfloat16, device=DEVICE)
    assert lora_grad_u(dys, bs, scales, u) is u
    want = lora_grad_u_reference(dys, bs, scales, torch.empty_like(u))
    # float32 sums in another order, rounded once to bf16: one unit in the last place
    torch.testing.assert_close(u.float(), want.float(), rtol=8e-3, atol=1e-2)
    for dtype in (torch.float32, torch.bfloat16):
        got = lora_grad_b(dys, hx, scales, ranks, dtype)
        want = lora_grad_b_reference(dys, hx, scales, ranks, dtype)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == dtype and a.shape == b.shape
            tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {}
            torch.testing.assert_close(a, b, **tol)


def test_what_the_kernels_do_not_take():
    dys, bs, _, _ = _case(8, [8, 8, 8], [2, 2, 2], torch.float32)
    assert takes_lora_grads(dys, bs)
    assert not takes_lora_grads(dys + dys[:1], bs + bs[:1])  # four projections
    assert not takes_lora_grads([None, *dys[1:]], bs)  # an unused output
    assert not takes_lora_grads([d.float() for d in dys], bs)  # float32 gradients
    assert not takes_lora_grads([dys[0], dys[1].half(), dys[2]], bs)  # mixed dtypes
    assert not takes_lora_grads(dys, [bs[0], bs[1].double(), bs[2]])
    assert not takes_lora_grads([d.T for d in dys], bs)  # columns not contiguous
