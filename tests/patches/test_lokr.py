"""LoKr: Kronecker product of two (possibly low-rank or Tucker) factors, against float64 math."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import AdapterFormatError, ShapeMismatchError
from shuttle.patches import LoKr
from tests import close


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
    # a typed error (not an assert, which python -O drops) naming the tensors and the fix
    with pytest.raises(AdapterFormatError, match="needs lokr_w1, or lokr_w1_a with lokr_w1_b"):
        LoKr("weight", w2=torch.randn(2, 2))
    with pytest.raises(AdapterFormatError, match="lokr_w2.*export it again"):
        LoKr("weight", w1=torch.randn(2, 2), w2=torch.randn(2, 2), w2a=torch.randn(2, 1),
             w2b=torch.randn(1, 2))
    with pytest.raises(AdapterFormatError, match="lokr_w2_b"):  # half of a low-rank pair
        LoKr("weight", w1=torch.randn(2, 2), w2a=torch.randn(2, 1))
    with pytest.raises(AdapterFormatError, match="layout"):
        LoKr("weight", w1=torch.randn(2, 2), w2=torch.randn(2, 2), layout="kohya")


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


def test_peft_layout_of_a_3d_w2_is_peft_make_kron():
    """PEFT's make_kron unsqueezes w1 for a 4-D w2 only: a Conv1d's full (c, d, k) w2 takes
    kron(w1[None], w2) reshaped, not LyCORIS's kron(w1[..., None], w2)."""
    w1, w2 = torch.randn(2, 3), torch.randn(3, 2, 5)
    shape = (6, 6, 5)
    peft_like = torch.kron(w1.double()[None], w2.double()).reshape(shape) * 0.5
    p = LoKr("weight", w1=w1, w2=w2, scale=0.5, layout="peft")
    assert p.peft_layout
    close(p.delta(shape), peft_like)
    lycoris = LoKr("weight", w1=w1, w2=w2, scale=0.5)
    close(lycoris.delta(shape), 0.5 * kron64(w1, w2))
    assert not torch.allclose(peft_like, 0.5 * kron64(w1, w2))  # the two layouts differ
    # 2-D and 4-D w2: PEFT and LyCORIS agree, so the flag changes nothing
    for w2, shape in ((torch.randn(3, 2), (6, 6)), (torch.randn(3, 2, 3, 3), (6, 6, 3, 3))):
        a = LoKr("weight", w1=w1, w2=w2, layout="peft")
        assert not a.peft_layout
        assert torch.equal(a.delta(shape), LoKr("weight", w1=w1, w2=w2).delta(shape))


def test_peft_make_kron_itself():
    make_kron = pytest.importorskip("peft.tuners.lokr.layer").make_kron
    w1, w2 = torch.randn(2, 2), torch.randn(3, 2, 3)
    p = LoKr("weight", w1=w1, w2=w2, scale=0.25, layout="peft")
    assert torch.equal(p.delta((6, 4, 3)), make_kron(w1, w2, 0.25).reshape(6, 4, 3))


def test_peft_lokr_conv1d_with_a_full_w2_merges_as_peft(tmp_path):
    """A file PEFT wrote (LoKrConfig, decompose_both=False, rank high enough that lokr_w2 is
    full and 3-D on the Conv1d): shuttle's merge equals PEFT's merge_and_unload() bit for bit,
    and its dynamic forward equals PEFT's unmerged forward."""
    peft = pytest.importorskip("peft")

    class Base(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(4, 6, 3, padding=1)
            self.c2 = nn.Conv2d(4, 6, 3)  # 4-D w2: the layouts agree

    torch.manual_seed(0)
    base = Base()
    config = peft.LoKrConfig(r=4, alpha=2, target_modules=["conv", "c2"], decompose_both=False,
                             init_weights=False)
    pm = peft.get_peft_model(copy.deepcopy(base), config)
    pm.save_pretrained(tmp_path)
    x1, x2 = torch.randn(2, 4, 7), torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        want_forward = (pm.base_model.model.conv(x1), pm.base_model.model.c2(x2))
    want = pm.merge_and_unload()
    lora = shuttle.load_lora(tmp_path)
    (patch,) = lora.modules["base_model.model.conv"]
    assert patch.kind == "lokr" and len(patch.w2.shape) == 3  # the case under test
    merged = copy.deepcopy(base)
    shuttle.merge_lora(merged, [(lora, 1.0)])
    for name, p in want.named_parameters():
        assert torch.equal(dict(merged.named_parameters())[name], p), name
    dyn = copy.deepcopy(base)
    with torch.no_grad(), shuttle.apply_lora(dyn, [(lora, 1.0)], mode="dynamic"):
        got = (dyn.conv(x1), dyn.c2(x2))
    for g, w in zip(got, want_forward, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert patch.peft_layout
