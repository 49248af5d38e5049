"""The fused merge into scaled int8/float8 weights against its PyTorch reference, torch's own
rounding, float64 math, and each representation's ``encode``.

On CPU the kernels run under TRITON_INTERPRET=1 (set in conftest): tiny shapes and 16x16 tiles
keep the file fast; (37, 45) spans 3x3 tiles with partial edge tiles on both axes.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from shuttle.kernels import triton_available
from shuttle.kernels.merge_scaled import merge_scaled, merge_scaled_or_none, merge_scaled_reference
from shuttle.weights import BnbInt8Weight, Fp8Weight, QuantoWeight, TorchaoScaledWeight
from tests.kernels.test_rounding import fp8_gap

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")
# The module, not the function of the same name that shuttle.kernels re-exports.
ms = importlib.import_module("shuttle.kernels.merge_scaled")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = (16, 16, 1)
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
# (code dtype, scale granularity); "absmax" is bitsandbytes' int8 (per-row absmax as scale)
FORMS = [(torch.int8, "row"), (torch.int8, "tensor"), (torch.int8, "absmax"), (E4, "row"),
         (E4, "tensor"), (E4, "none"), (E5, "row"), (E5, "none")]
IDS = [f"{str(d).split('.')[-1]}-{g}" for d, g in FORMS]


def _codes(dtype, m, n, g):
    if dtype == torch.int8:
        return torch.randint(-127, 128, (m, n), generator=g).to(torch.int8)
    return (torch.randn(m, n, generator=g) * 30).clamp(-400, 400).to(dtype)


def _scale(gran, m, g):
    return {"none": None, "tensor": torch.tensor(0.013),
            "row": torch.rand(m, generator=g) * 0.05 + 1e-3,
            "absmax": torch.rand(m, generator=g) * 3 + 0.1}[gran]


def _case(dtype, gran, m=37, n=45, ranks=(5, 7, 3), fdtype=torch.bfloat16, seed=0):
    """Codes, scale and three contributions of different scales, ranks not powers of two."""
    g = torch.Generator().manual_seed(seed)
    data, scale = _codes(dtype, m, n, g), _scale(gran, m, g)
    r = sum(ranks)
    up = (torch.randn(m, r, generator=g) * 0.2).to(fdtype)
    down = (torch.randn(r, n, generator=g) * 0.2).to(fdtype)
    seg = [0]
    for k in ranks:
        seg.append(seg[-1] + k)
    scales = [0.7, -1.3, 0.45][:len(ranks)]
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(data), to(scale), to(up), to(down), seg, scales


def _index(codes):
    """Codes as ordered integers: adjacent representable values differ by 1 (float8: the
    sign-magnitude byte, so +0 and -0 are both 0)."""
    if codes.dtype == torch.int8:
        return codes.long()
    b = codes.view(torch.uint8).long()
    return torch.where(b >= 128, -(b & 127), b)


def _assert_within_a_step(got, want):
    """Float32 summation order (tl.dot per 16 ranks vs addmm) moves x by a few float32 ulps, so
    a code can differ only where x / s lies within those ulps of a midpoint: by one step, on at
    most 1% of elements (a few at least)."""
    d = (_index(got) - _index(want)).abs()
    assert int(d.max()) <= 1
    assert int((d > 0).sum()) <= max(3, got.numel() // 100)


def _assert_scale_close(got, want):
    """Equal within the rounding of the scale's dtype (amax summed in another order)."""
    if want is None:
        assert got is None
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol = 4e-7 if want.dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got, want, rtol=rtol, atol=0)


@pytest.mark.parametrize(("dtype", "gran"), FORMS, ids=IDS)
def test_nearest_matches_reference(dtype, gran):
    fdtype = torch.float32 if gran in ("tensor", "none") else torch.bfloat16
    data, scale, up, down, seg, scales = _case(dtype, gran, fdtype=fdtype)
    kw = dict(absmax_scale=gran == "absmax")
    got = merge_scaled(data, scale, up, down, seg, scales, config=CFG, **kw)
    want = merge_scaled_reference(data, scale, up, down, seg, scales, **kw)
    assert got.data.dtype == dtype and got.data.shape == data.shape
    _assert_within_a_step(got.data, want.data)
    _assert_scale_close(got.scale, want.scale)
    torch.testing.assert_close(got.amax, want.amax, rtol=4e-7, atol=0)
    assert torch.equal(data, _case(dtype, gran, fdtype=fdtype)[0])  # inputs untouched


def _exact_values(dtype, m):
    """(m, 16) float32 values the kernel sees exactly (x = v @ I): midpoints (ties), subnormal
    midpoints, values beyond the range, tiny negatives, a zero row, and random magnitudes."""
    g = torch.Generator().manual_seed(3)
    v = torch.randn(m, 16, generator=g) * torch.logspace(-4, 2, m).unsqueeze(1)
    if dtype == torch.int8:  # with amax 127 the scale is 1: x / s are these very numbers
        special = [127.0, -127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5, 4.4999995]
    else:
        tiny = torch.finfo(dtype).tiny
        sub = tiny * 2.0 ** -(3 if dtype == E4 else 2)  # the smallest subnormal
        fmax = torch.finfo(dtype).max
        special = [fmax, -fmax, 1.0625, -1.1875, 1.5 * sub, -2.5 * sub, 0.4 * sub, -0.4 * sub,
                   fmax * 1.5, -1e30]
    v[0, :len(special)] = torch.tensor(special)
    v[1] = 0.0
    return v


@pytest.mark.parametrize(("dtype", "gran"), FORMS, ids=IDS)
def test_exact_inputs_round_like_torch_bit_for_bit(dtype, gran):
    """With x exact in float32 the kernel's hand rounding, clamping and zero-row scales equal
    the reference (torch's cast and round, ties to even) to the bit."""
    m = 20
    v = _exact_values(dtype, m).to(DEVICE)
    data = torch.zeros(m, 16, dtype=dtype, device=DEVICE)
    g = torch.Generator().manual_seed(0)
    scale = _scale(gran, m, g)
    scale = None if scale is None else scale.to(DEVICE)
    eye = torch.eye(16, device=DEVICE)
    kw = dict(absmax_scale=gran == "absmax")
    got = merge_scaled(data, scale, v, eye, [0, 16], [1.0], config=CFG, **kw)
    want = merge_scaled_reference(data, scale, v, eye, [0, 16], [1.0], **kw)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert (got.scale is None) == (want.scale is None)
    if got.scale is not None:
        assert torch.equal(got.scale, want.scale)
        zero_row_scale = got.scale[1] if got.scale.dim() else None
        if zero_row_scale is not None:  # a zero row: scale 1, or an absmax of 0 (bnb)
            assert float(zero_row_scale) == (0.0 if gran == "absmax" else 1.0)
    if gran == "none":  # beyond the range: clamped to ±finfo.max, not inf/NaN
        fmax = torch.finfo(dtype).max
        assert got.data[0, 8].float() == fmax and got.data[0, 9].float() == -fmax
        assert bool(torch.isfinite(got.data.float()).all())


@pytest.mark.parametrize("dtype", [torch.int8, E4])
def test_stochastic_repeatable_seeded_and_independent_of_tiling(dtype):
    data, scale, up, down, seg, scales = _case(dtype, "row")
    args = (data, scale, up, down, seg, scales)
    a = merge_scaled(*args, rounding="stochastic", seed=7, config=CFG)
    b = merge_scaled(*args, rounding="stochastic", seed=7, config=(32, 16, 1))
    c = merge_scaled(*args, rounding="stochastic", seed=8, config=CFG)
    near = merge_scaled(*args, config=CFG)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert not torch.equal(a.data.view(torch.uint8), c.data.view(torch.uint8))
    # each result is one of the two codes around x / s: at most one step from nearest
    assert int((_index(a.data) - _index(near.data)).abs().max()) <= 1
    assert torch.equal(a.scale, near.scale)


@pytest.mark.parametrize(("dtype", "gran"), [(torch.int8, "row"), (E4, "tensor")])
def test_stochastic_is_unbiased(dtype, gran):
    """Mean over draws of the dequantized result -> the float64 merge. Four distinct rows, each
    repeated 16 times (same amax, so same scale; other offsets, so independent draws), times
    16 seeds: K = 256 draws per value, standard error <= step / (2 sqrt(K)) = step / 32."""
    data, scale, up, down, seg, scales = _case(dtype, gran, m=4, n=16)
    rep = lambda t: t.repeat(16, 1)  # noqa: E731
    data, up = rep(data), rep(up)
    if gran == "row":
        scale = rep(scale.view(-1, 1)).view(-1)
    exact = data.double() * (scale.double().view(-1, 1) if scale.dim() else scale.double())
    for i, a in enumerate(scales):
        exact += a * (up[:, seg[i]:seg[i + 1]].double() @ down[seg[i]:seg[i + 1]].double())
    total = torch.zeros(4, 16, dtype=torch.float64, device=DEVICE)
    for seed in range(16):
        out = merge_scaled(data, scale, up, down, seg, scales, rounding="stochastic", seed=seed,
                           config=(64, 16, 1))
        s = out.scale.double().view(-1, 1) if out.scale.dim() else out.scale.double()
        total += (out.data.double() * s).view(16, 4, 16).sum(0)  # the 16 copies of each row
    mean, exact, s = total / 256, exact[:4], s[:4] if s.dim() else s
    step = s.expand_as(exact) if dtype == torch.int8 else fp8_gap(exact / s, dtype) * s
    err = (mean - exact).abs() / step
    assert float(err.max()) < 5 / (2 * math.sqrt(256))  # 5 standard errors
    assert float(err.mean()) < 0.06  # nearest rounding would average ~0.25 of a step


def test_non_finite_merge_gives_inf_amax_and_no_representation():
    data, scale, up, down, seg, scales = _case(E4, "row", m=16, n=16)
    up[3, 2] = float("nan")
    out = merge_scaled(data, scale, up, down, seg, scales, config=CFG)
    assert float(out.amax) == float("inf")
    assert Fp8Weight(data, scale).merge_lowrank(up, down, seg, scales) is None
    up[3, 2] = float("inf")  # unscaled: clamping would hide it; the amax does not
    assert Fp8Weight(data).merge_lowrank(up, down, seg, scales) is None


def _reps():
    """name -> (representation, rows); library-free constructions of each form."""
    g = torch.Generator().manual_seed(5)
    i8 = _codes(torch.int8, 24, 18, g)
    e4 = _codes(E4, 24, 18, g)
    row = torch.rand(24, generator=g) * 0.05 + 1e-3
    return {
        "fp8-none-4d": Fp8Weight(_codes(E4, 24, 18, g).view(24, 3, 2, 3)),
        "fp8-tensor": Fp8Weight(e4, torch.tensor(0.02)),
        "fp8-row-e5m2": Fp8Weight(_codes(E5, 24, 18, g), row),
        "bnb-int8": BnbInt8Weight(i8, torch.rand(24, generator=g) * 3 + 0.1),
        "quanto-int8-bf16-scale": QuantoWeight(i8, row.view(-1, 1).bfloat16(), torch.bfloat16),
        "quanto-fp8-row": QuantoWeight(e4, row.view(-1, 1), torch.bfloat16),
        "torchao-int8-row": TorchaoScaledWeight(i8, row.view(-1, 1), torch.zeros(24, 1),
                                                torch.bfloat16),
        "torchao-fp8-tensor": TorchaoScaledWeight(e4, torch.full((1, 1), 0.02), None,
                                                  torch.bfloat16),
    }


@pytest.mark.parametrize("name", list(_reps()))
def test_representation_merge_is_its_encode(name):
    rep = _reps()[name].to(DEVICE)
    _, _, up, down, seg, scales = _case(E4, "none", m=24, n=18)
    out = rep.merge_lowrank(up, down, seg, scales, rounding="nearest", seed=0)
    update = sum(a * (up[:, seg[i]:seg[i + 1]].float() @ down[seg[i]:seg[i + 1]].float())
                 for i, a in enumerate(scales))
    want = rep.encode(rep.dequantize() + update.view(rep.logical_shape))
    assert type(out) is type(want) and out.compute_dtype == rep.compute_dtype
    got_t, want_t = out.tensors(), want.tensors()
    assert got_t.keys() == want_t.keys() == rep.tensors().keys()
    for k in want_t:  # what write_back / write_into need: the stored tensors' form
        assert (got_t[k].shape, got_t[k].dtype) == (want_t[k].shape, want_t[k].dtype), k
    codes = "qdata" if "qdata" in want_t else "data"
    _assert_within_a_step(got_t[codes], want_t[codes])
    for k in set(want_t) - {codes}:
        _assert_scale_close(got_t[k], want_t[k])


def test_none_where_the_kernel_does_not_apply(monkeypatch):
    _, _, up, down, seg, scales = _case(E4, "none", m=8, n=16)
    codes = _codes(torch.int8, 8, 16, torch.Generator().manual_seed(0))
    col_scale = QuantoWeight(codes, torch.rand(1, 16), torch.bfloat16)  # per column (axis=-1)
    assert col_scale.merge_lowrank(up, down, seg, scales) is None
    blockwise = TorchaoScaledWeight(codes, torch.rand(8, 2), None, torch.bfloat16)
    assert blockwise.merge_lowrank(up, down, seg, scales) is None
    strided = Fp8Weight(_codes(E4, 16, 8, torch.Generator().manual_seed(1)).t())
    assert strided.merge_lowrank(up, down, seg, scales) is None
    fnuz = codes.float().to(torch.float8_e4m3fnuz)
    assert merge_scaled_or_none(fnuz, torch.tensor(1.0), up, down, seg, scales) is None
    ok = Fp8Weight(_codes(E4, 8, 16, torch.Generator().manual_seed(2)))
    if DEVICE == "cpu":  # a CPU tensor outside the interpreter has no kernel
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert ok.merge_lowrank(up, down, seg, scales) is None
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ms, "triton_available", lambda: False)
    assert ok.to(DEVICE).merge_lowrank(up, down, seg, scales) is None
