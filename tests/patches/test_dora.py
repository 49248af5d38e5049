"""DoRA: "inner" (PEFT), "blend" (ComfyUI) and "lycoris" strength rules, row and column norms.

LyCORIS's own library is the reference in test_dora_lycoris.py; here float64 math.
"""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import ShapeMismatchError
from shuttle.patches import DoRA, LoHa, LowRank, TensorRef
from tests import close


class Ref:
    def __init__(self, t: torch.Tensor):
        self._t, self.shape, self.dtype, self.loads = t, t.shape, t.dtype, 0

    def load(self) -> torch.Tensor:
        self.loads += 1
        return self._t


def lowrank_delta64(up, down, scale):
    return scale * (up.double().flatten(1) @ down.double().flatten(1))


def norm64(v: torch.Tensor, axis: str) -> torch.Tensor:
    """L2 norm per output row (over all other axes) or per input column (over axes != 1)."""
    if axis == "row":
        return v.flatten(1).pow(2).sum(1).sqrt().reshape(-1, *[1] * (v.dim() - 1))
    moved = v.transpose(0, 1).flatten(1)
    return moved.pow(2).sum(1).sqrt().reshape(1, -1, *[1] * (v.dim() - 2))


def inner64(w, delta, m, k, axis):
    v = w.double() + k * delta
    return m.double().reshape(norm64(v, axis).shape) * v / norm64(v, axis)


def blend64(w, delta, m, k, axis):
    v = w.double() + delta
    d = m.double().reshape(norm64(v, axis).shape) * v / norm64(v, axis)
    return w.double() + k * (d - w.double())


def lycoris64(w, delta, m, k, axis):
    """LyCORIS weight_decompose: V * (k * (m / (||V|| + eps) - 1) + 1) = V + k * (D - V)."""
    v = w.double() + delta
    ratio = m.double().reshape(norm64(v, axis).shape) / (norm64(v, axis) + EPS32)
    return v * (k * (ratio - 1) + 1)


EPS32 = torch.finfo(torch.float32).eps


def make(out_f=6, in_f=4, r=2, kernel=()):
    up = torch.randn(out_f, r, *[1] * len(kernel))
    down = torch.randn(r, in_f, *kernel)
    w = torch.randn(out_f, in_f, *kernel)
    return w, up, down


@pytest.mark.parametrize("k", [1.0, 0.5, -0.3, 2.0])
def test_inner_linear_rows(k):
    w, up, down = make()
    m = torch.rand(6) + 0.5  # PEFT lora_magnitude_vector (out,)
    s = 0.75
    p = DoRA("weight", magnitude=m, inner=LowRank("weight", up=up, down=down, scale=s),
             mode="inner")
    p.check(tuple(w.shape), "lin.weight")
    expected = inner64(w, lowrank_delta64(up, down, s), m, k, "row")
    close(p.apply(w.clone(), k), expected)


@pytest.mark.parametrize("k", [1.0, 0.5, -0.3, 2.0])
def test_blend_linear_rows(k):
    w, up, down = make()
    m = torch.rand(6, 1) + 0.5  # LyCORIS dora_scale (out, 1)
    s = 1.25
    p = DoRA("weight", magnitude=m, inner=LowRank("weight", up=up, down=down, scale=s),
             mode="blend")
    expected = blend64(w, lowrank_delta64(up, down, s), m, k, "row")
    close(p.apply(w.clone(), k), expected)


@pytest.mark.parametrize("k", [1.0, 0.5, -0.3, 2.0])
def test_lycoris_linear_rows(k):
    w, up, down = make()
    m = torch.rand(6, 1) + 0.5  # LyCORIS dora_scale (out, 1)
    s = 1.25
    p = DoRA("weight", magnitude=m, inner=LowRank("weight", up=up, down=down, scale=s),
             mode="lycoris")
    delta = lowrank_delta64(up, down, s)
    expected = lycoris64(w, delta, m, k, "row")
    close(p.apply(w.clone(), k), expected)
    # LyCORIS's rule minus ComfyUI's: (1 - k) * (V - W) = (1 - k) * s * delta
    comfy = DoRA("weight", magnitude=m, inner=p.inner, mode="blend").apply(w.clone(), k)
    close(p.apply(w.clone(), k) - comfy, (1 - k) * delta)


@pytest.mark.parametrize("mode", ["blend", "lycoris"])
def test_strength_zero_is_off(mode):
    # LyCORIS's formula would leave V = W + s * delta at k = 0; in shuttle 0 means off, as
    # merges drop zero strengths before any patch sees them.
    w, up, down = make()
    p = DoRA("weight", magnitude=torch.rand(6, 1) + 0.5,
             inner=LowRank("weight", up=up, down=down), mode=mode)
    assert torch.equal(p.apply(w.clone(), 0.0), w)


def test_dora_scale_eps():
    # A row whose V is zero: LyCORIS and ComfyUI divide by ||V|| + eps, so it stays zero.
    w = torch.zeros(3, 4)
    w[1:] = torch.randn(2, 4)
    up, down = torch.zeros(3, 1), torch.zeros(1, 4)
    for mode in ("blend", "lycoris"):
        p = DoRA("weight", magnitude=torch.ones(3, 1), inner=LowRank("weight", up=up, down=down),
                 mode=mode)
        out = p.apply(w.clone(), 0.5)
        assert torch.isfinite(out).all() and not out[0].any()


@pytest.mark.parametrize("mode", ["inner", "blend", "lycoris"])
def test_columns(mode):
    w, up, down = make(out_f=6, in_f=4)
    m = torch.rand(1, 4) + 0.5  # per input column (wd_on_out=False)
    p = DoRA("weight", magnitude=m, inner=LowRank("weight", up=up, down=down, scale=0.5),
             mode=mode)
    p.check(tuple(w.shape), "lin.weight")
    ref = {"inner": inner64, "blend": blend64, "lycoris": lycoris64}[mode]
    close(p.apply(w.clone(), 0.6), ref(w, lowrank_delta64(up, down, 0.5), m, 0.6, "col"))


def test_blend_square_columns():
    w, up, down = make(out_f=5, in_f=5)
    m = torch.rand(1, 5) + 0.5
    p = DoRA("weight", magnitude=m, inner=LowRank("weight", up=up, down=down), mode="blend")
    close(p.apply(w.clone(), 0.4), blend64(w, lowrank_delta64(up, down, 1.0), m, 0.4, "col"))


def test_modes_agree_at_strength_one():
    w, up, down = make()
    m = torch.rand(6) + 0.5
    inner = LowRank("weight", up=up, down=down, scale=0.3)
    a = DoRA("weight", magnitude=m, inner=inner, mode="inner").apply(w.clone(), 1.0)
    b = DoRA("weight", magnitude=m, inner=inner, mode="blend").apply(w.clone(), 1.0)
    c = DoRA("weight", magnitude=m, inner=inner, mode="lycoris").apply(w.clone(), 1.0)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    close(a, inner64(w, lowrank_delta64(up, down, 0.3), m, 1.0, "row"))


@pytest.mark.parametrize("in_c", [3, 5], ids=["in!=out", "in==out"])
@pytest.mark.parametrize("mshape", [(5,), (5, 1, 1, 1), (1, 5, 1, 1)],
                         ids=["flat", "lycoris", "peft"])
def test_conv2d_rows_inner(in_c, mshape):
    # PEFT's conv magnitude is (1, out, 1, 1); it is per output row even for a square conv.
    w, up, down = make(out_f=5, in_f=in_c, kernel=(3, 3))
    m = torch.rand(mshape) + 0.5
    p = DoRA("weight", magnitude=m, inner=LowRank("weight", up=up, down=down, scale=0.5),
             mode="inner")
    p.check(tuple(w.shape), "c.weight")
    delta = lowrank_delta64(up, down, 0.5).reshape(w.shape)
    close(p.apply(w.clone(), 0.7), inner64(w, delta, m, 0.7, "row"))


@pytest.mark.parametrize("kernel", [(3,), (3, 3), (2, 2, 2)], ids=["conv1d", "conv2d", "conv3d"])
def test_conv_blend_rows_and_columns(kernel):
    w, up, down = make(out_f=4, in_f=3, kernel=kernel)
    delta = lowrank_delta64(up, down, 2.0).reshape(w.shape)
    inner = LowRank("weight", up=up, down=down, scale=2.0)
    rows = torch.rand(4, *[1] * (len(kernel) + 1)) + 0.5
    cols = torch.rand(1, 3, *[1] * len(kernel)) + 0.5
    close(DoRA("weight", magnitude=rows, inner=inner, mode="blend").apply(w.clone(), 0.5),
          blend64(w, delta, rows, 0.5, "row"))
    close(DoRA("weight", magnitude=cols, inner=inner, mode="blend").apply(w.clone(), 0.5),
          blend64(w, delta, cols, 0.5, "col"))
    close(DoRA("weight", magnitude=rows, inner=inner, mode="lycoris").apply(w.clone(), 0.5),
          lycoris64(w, delta, rows, 0.5, "row"))
    close(DoRA("weight", magnitude=cols, inner=inner, mode="lycoris").apply(w.clone(), 0.5),
          lycoris64(w, delta, cols, 0.5, "col"))


def test_inner_loha():
    out_f, in_f, r = 5, 4, 2
    w1a, w1b, w2a, w2b = (torch.randn(out_f, r), torch.randn(r, in_f), torch.randn(out_f, r),
                          torch.randn(r, in_f))
    loha = LoHa("weight", w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b, scale=0.5, alpha_value=1.0)
    m = torch.rand(out_f, 1) + 0.5
    p = DoRA("weight", magnitude=m, inner=loha, mode="blend")
    delta = 0.5 * (w1a.double() @ w1b.double()) * (w2a.double() @ w2b.double())
    w = torch.randn(out_f, in_f)
    close(p.apply(w.clone(), 0.8), blend64(w, delta, m, 0.8, "row"))
    assert p.rank == r and p.alpha == 1.0 and p.out_rows == out_f


def test_check_mismatch():
    w, up, down = make(out_f=6, in_f=4)
    inner = LowRank("weight", up=up, down=down)
    with pytest.raises(ShapeMismatchError, match="DoRA magnitude for 'lin.weight'"):
        DoRA("weight", magnitude=torch.rand(5), inner=inner).check((6, 4), "lin.weight")
    with pytest.raises(ShapeMismatchError, match="DoRA magnitude"):
        DoRA("weight", magnitude=torch.rand(2, 4), inner=inner).check((6, 4), "lin.weight")
    # the inner patch is checked too
    with pytest.raises(ShapeMismatchError, match="lora patch"):
        DoRA("weight", magnitude=torch.rand(6), inner=inner).check((6, 5), "lin.weight")


def test_tensors_load_and_no_delta():
    up, down, m = torch.randn(6, 2), torch.randn(2, 4), torch.rand(6)
    refs = [Ref(m), Ref(up), Ref(down)]
    assert all(isinstance(r, TensorRef) for r in refs)
    p = DoRA("weight", magnitude=refs[0], inner=LowRank("weight", up=refs[1], down=refs[2]))
    assert [n for n, _ in p.tensors()] == ["magnitude", "inner.up", "inner.down"]
    assert p.shapes() == {"magnitude": (6,), "inner.up": (6, 2), "inner.down": (2, 4)}
    assert p.nbytes == (6 + 12 + 8) * 4
    p.check((6, 4), "lin.weight")
    assert [r.loads for r in refs] == [0, 0, 0]
    loaded = p.load()
    assert loaded.magnitude is m and loaded.inner.up is up and loaded.inner.down is down
    assert loaded.mode == "inner" and not loaded.additive
    with pytest.raises(TypeError, match="apply"):
        loaded.delta((6, 4))
