"""LoHa: Hadamard product of two low-rank products, plain and Tucker, against float64 math."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import ShapeMismatchError
from shuttle.patches import LoHa
from tests import close


def tucker64(t, wa, wb):
    """sum_ij t[i, j, ...] wa[i, p] wb[j, q], written as explicit loops over the rank."""
    t, wa, wb = t.double(), wa.double(), wb.double()
    k = t.shape[2:]
    out = torch.zeros(wa.shape[1], wb.shape[1], *k, dtype=torch.float64)
    for i in range(t.shape[0]):
        for j in range(t.shape[1]):
            outer = torch.outer(wa[i], wb[j]).reshape(wa.shape[1], wb.shape[1], *[1] * len(k))
            out += t[i, j] * outer
    return out


def test_linear():
    out_f, in_f, r = 6, 5, 3
    w1a, w1b, w2a, w2b = (torch.randn(out_f, r), torch.randn(r, in_f), torch.randn(out_f, r),
                          torch.randn(r, in_f))
    alpha = 1.5
    p = LoHa("weight", w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b, scale=alpha / r, alpha_value=alpha)
    expected = (w1a.double() @ w1b.double()) * (w2a.double() @ w2b.double()) * (alpha / r)
    close(p.delta((out_f, in_f)), expected)
    w = torch.randn(out_f, in_f)
    close(p.apply(w.clone(), 0.8), w.double() + 0.8 * expected)
    assert p.rank == r and p.alpha == alpha and p.out_rows == out_f
    p.check((out_f, in_f), "lin.weight")


@pytest.mark.parametrize("kernel", [(3,), (3, 3), (2, 2, 3)], ids=["conv1d", "conv2d", "conv3d"])
@pytest.mark.parametrize("flat_b", [True, False], ids=["w_b-2d", "w_b-nd"])
def test_conv_without_tucker(kernel, flat_b):
    out_c, in_c, r = 4, 3, 2
    kn = torch.Size(kernel).numel()
    w1a, w2a = torch.randn(out_c, r), torch.randn(out_c, r)
    w1b, w2b = torch.randn(r, in_c * kn), torch.randn(r, in_c * kn)
    expected = ((w1a.double() @ w1b.double()) * (w2a.double() @ w2b.double()) * 0.5).reshape(
        out_c, in_c, *kernel)
    if not flat_b:
        w1b, w2b = w1b.reshape(r, in_c, *kernel), w2b.reshape(r, in_c, *kernel)
    p = LoHa("weight", w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b, scale=0.5)
    shape = (out_c, in_c, *kernel)
    p.check(shape, "c.weight")
    close(p.delta(shape), expected)
    w = torch.randn(shape)
    close(p.apply(w.clone(), -1.0), w.double() - expected)


@pytest.mark.parametrize("kernel", [(3,), (3, 3), (2, 3, 2)], ids=["conv1d", "conv2d", "conv3d"])
def test_tucker(kernel):
    out_c, in_c, r = 5, 4, 3
    t1, t2 = torch.randn(r, r, *kernel), torch.randn(r, r, *kernel)
    w1a, w2a = torch.randn(r, out_c), torch.randn(r, out_c)  # (r, out) in the Tucker form
    w1b, w2b = torch.randn(r, in_c), torch.randn(r, in_c)
    p = LoHa("weight", w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b, t1=t1, t2=t2, scale=0.25)
    shape = (out_c, in_c, *kernel)
    assert p.out_rows == out_c and p.rank == r
    p.check(shape, "c.weight")
    expected = tucker64(t1, w1a, w1b) * tucker64(t2, w2a, w2b) * 0.25
    close(p.delta(shape), expected)
    w = torch.randn(shape)
    close(p.apply(w.clone(), 1.7), w.double() + 1.7 * expected)


def test_tucker_einsum_convention():
    # The docstring's einsum "i j ..., i p, j q -> p q ..." is the loop form above.
    t, wa, wb = torch.randn(2, 3, 2, 2).double(), torch.randn(2, 5).double(), \
        torch.randn(3, 4).double()
    torch.testing.assert_close(torch.einsum("i j ..., i p, j q -> p q ...", t, wa, wb),
                               tucker64(t, wa, wb))


def test_check_mismatch():
    p = LoHa("weight", w1a=torch.randn(6, 2), w1b=torch.randn(2, 4), w2a=torch.randn(6, 2),
             w2b=torch.randn(2, 4))
    with pytest.raises(ShapeMismatchError, match="loha patch for 'x.weight'"):
        p.check((6, 5), "x.weight")
    with pytest.raises(ShapeMismatchError, match="x.weight"):
        p.check((4, 6), "x.weight")
    tucker = LoHa("weight", w1a=torch.randn(2, 6), w1b=torch.randn(2, 4), w2a=torch.randn(2, 6),
                  w2b=torch.randn(2, 4), t1=torch.randn(2, 2, 3, 3), t2=torch.randn(2, 2, 3, 3))
    tucker.check((6, 4, 3, 3), "c.weight")
    with pytest.raises(ShapeMismatchError, match="c.weight"):
        tucker.check((6, 4, 1, 1), "c.weight")


def test_shapes_and_nbytes():
    p = LoHa("weight", w1a=torch.randn(6, 2).half(), w1b=torch.randn(2, 4).half(),
             w2a=torch.randn(6, 2).half(), w2b=torch.randn(2, 4).half())
    assert p.shapes() == {"w1a": (6, 2), "w1b": (2, 4), "w2a": (6, 2), "w2b": (2, 4)}
    assert p.nbytes == 2 * (12 + 8) * 2
    assert p.dtype == torch.float16
    assert p.alpha is None
