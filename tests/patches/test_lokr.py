"""LoKr: Kronecker product of two (possibly low-rank or Tucker) factors, against float64 math."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import ShapeMismatchError
from shuttle.patches import LoKr


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5)


def kron64(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """kron(w1 (a, b), w2 (c, d, k...)) -> (a*c, b*d, k...) by index arithmetic."""
    w1, w2 = w1.double(), w2.double()
    a, b = w1.shape
    c, d, *k = w2.shape
    out = torch.empty(a * c, b * d, *k, dtype=torch.float64)
    for i in range(a):
        for j in range(b):
            out[i * c:(i + 1) * c, j * d:(j + 1) * d] = w1[i, j] * w2
    return out


def test_full_factors_linear():
    w1, w2 = torch.randn(2, 3), torch.randn(4, 5)
    p = LoKr("weight", w1=w1, w2=w2)
    expected = kron64(w1, w2)
    assert expected.shape == (8, 15)
    close(p.delta((8, 15)), expected)
    w = torch.randn(8, 15)
    close(p.apply(w.clone(), 0.6), w.double() + 0.6 * expected)
    assert p.rank is None and p.alpha is None and p.out_rows == 8
    p.check((8, 15), "lin.weight")


def test_decomposed_factors_linear():
    r = 2
    w1a, w1b = torch.randn(3, r), torch.randn(r, 2)
    w2a, w2b = torch.randn(4, r), torch.randn(r, 6)
    alpha = 3.0
    p = LoKr("weight", w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b, scale=alpha / r, alpha_value=alpha)
    expected = kron64(w1a.double() @ w1b.double(), w2a.double() @ w2b.double()) * (alpha / r)
    close(p.delta((12, 12)), expected)
    assert p.rank == r and p.alpha == alpha


def test_rank_from_w2b_when_w1_full():
    p = LoKr("weight", w1=torch.randn(2, 2), w2a=torch.randn(3, 4), w2b=torch.randn(4, 5))
    assert p.rank == 4
    p.check((6, 10), "x.weight")


@pytest.mark.parametrize("kernel", [(3,), (3, 3), (2, 3, 2)], ids=["conv1d", "conv2d", "conv3d"])
def test_conv_full_w2(kernel):
    w1, w2 = torch.randn(2, 2), torch.randn(3, 4, *kernel)
    shape = (6, 8, *kernel)
    p = LoKr("weight", w1=w1, w2=w2, scale=0.5)
    p.check(shape, "c.weight")
    expected = 0.5 * kron64(w1, w2)
    close(p.delta(shape), expected)
    w = torch.randn(shape)
    close(p.apply(w.clone(), 2.0), w.double() + 2.0 * expected)


@pytest.mark.parametrize("kernel", [(3,), (3, 3)], ids=["conv1d", "conv2d"])
def test_conv_decomposed_w2_flattened(kernel):
    # w2a @ w2b is (c, d * k...): the flattened kron must equal the kron of the conv layout.
    r, c, d = 2, 3, 4
    kn = torch.Size(kernel).numel()
    w1 = torch.randn(2, 2)
    w2a, w2b = torch.randn(c, r), torch.randn(r, d * kn)
    shape = (2 * c, 2 * d, *kernel)
    p = LoKr("weight", w1=w1, w2a=w2a, w2b=w2b, scale=1.5)
    p.check(shape, "c.weight")
    w2 = (w2a.double() @ w2b.double()).reshape(c, d, *kernel)
    close(p.delta(shape), 1.5 * kron64(w1, w2))


@pytest.mark.parametrize("kernel", [(3,), (3, 3), (2, 2, 3)], ids=["conv1d", "conv2d", "conv3d"])
def test_tucker_t2(kernel):
    r, c, d = 2, 3, 4
    w1a, w1b = torch.randn(2, r), torch.randn(r, 3)
    t2 = torch.randn(r, r, *kernel)
    w2a, w2b = torch.randn(r, c), torch.randn(r, d)  # (r, out) and (r, in) in the Tucker form
    shape = (2 * c, 3 * d, *kernel)
    p = LoKr("weight", w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b, t2=t2, scale=0.75)
    assert p.out_rows == 2 * c
    p.check(shape, "c.weight")
    w2 = torch.zeros(c, d, *kernel, dtype=torch.float64)
    for i in range(r):
        for j in range(r):
            w2 += t2[i, j].double() * torch.outer(w2a[i].double(), w2b[j].double()).reshape(
                c, d, *[1] * len(kernel))
    expected = 0.75 * kron64(w1a.double() @ w1b.double(), w2)
    close(p.delta(shape), expected)
    w = torch.randn(shape)
    close(p.apply(w.clone(), -0.5), w.double() - 0.5 * expected)


def test_check_mismatch():
    p = LoKr("weight", w1=torch.randn(2, 3), w2=torch.randn(4, 5))
    with pytest.raises(ShapeMismatchError, match="lokr patch for 'x.weight'"):
        p.check((8, 14), "x.weight")
    with pytest.raises(ShapeMismatchError, match="x.weight"):
        p.check((15, 8), "x.weight")  # same numel, wrong rows


def test_needs_one_spelling_of_each_factor():
    with pytest.raises(AssertionError, match="w1"):
        LoKr("weight", w2=torch.randn(2, 2))
    with pytest.raises(AssertionError, match="w2"):
        LoKr("weight", w1=torch.randn(2, 2), w2=torch.randn(2, 2), w2a=torch.randn(2, 1),
             w2b=torch.randn(1, 2))


def test_shapes_and_nbytes():
    p = LoKr("weight", w1=torch.randn(2, 2), w2a=torch.randn(3, 1), w2b=torch.randn(1, 4))
    assert p.shapes() == {"w1": (2, 2), "w2a": (3, 1), "w2b": (1, 4)}
    assert p.nbytes == (4 + 3 + 4) * 4


def test_non_contiguous_factors():
    # e.g. tensors from a torch.save'd file keep their strides
    w1, w2 = torch.randn(3, 2).T, torch.randn(5, 4, 3, 3).transpose(0, 1)
    assert not w1.is_contiguous() and not w2.is_contiguous()
    p = LoKr("weight", w1=w1, w2=w2)
    close(p.delta((8, 15, 3, 3)), kron64(w1, w2))
