"""The fused 4-bit merge kernel against its PyTorch reference, bitsandbytes and float64 math.

On CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest); on CUDA it is compiled.
"""

from __future__ import annotations

import pytest
import torch

from shuttle.kernels.launch import triton_available
from shuttle.kernels.merge_nf4 import merge_4bit, merge_4bit_reference
from shuttle.kernels.rounding import hash_uniform
from shuttle.weights import Bnb4bitWeight, represent

bnb = pytest.importorskip("bitsandbytes")
F = bnb.functional
pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Ranks of the contributions (padded to 16 and to each other inside the kernel) and scales.
RANKS, SCALES = [3, 4, 9], [0.5, -1.3, 0.21]


def _case(m, n, blocksize, quant_type, fdtype=torch.float32, seed=0, quant_storage=torch.uint8):
    """A bitsandbytes-quantized (m, n) weight and concatenated factors of three contributions."""
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes, as real weights have
    w = torch.randn(m, n, generator=g) * torch.logspace(-2, 1, m).unsqueeze(1)
    q, qs = F.quantize_4bit(w.to(DEVICE), blocksize=blocksize, quant_type=quant_type,
                            quant_storage=quant_storage)
    r = sum(RANKS)
    up = (torch.randn(m, r, generator=g) * 0.3).to(fdtype).to(DEVICE)
    down = (torch.randn(r, n, generator=g) * 0.3).to(fdtype).to(DEVICE)
    seg = [0, RANKS[0], RANKS[0] + RANKS[1], r]
    return q, qs, up, down, seg


def _float64_merged(q, qs, up, down, seg, scales):
    x = F.dequantize_4bit(q, qs).double()
    for i, a in enumerate(scales):
        x += a * (up[:, seg[i]:seg[i + 1]].double() @ down[seg[i]:seg[i + 1]].double())
    return x


def _indices(packed, numel):
    b = packed.contiguous().view(torch.uint8).reshape(-1)
    return torch.stack([b >> 4, b & 0x0F], dim=1).reshape(-1)[:numel].long()


def _assert_same_up_to_midpoints(got, want, code, exact, blocksize):
    """``got`` and ``want`` ``(packed, absmax)`` are the same encoding of ``exact`` (float64)
    except for float32 rounding: absmax to within 8 float32 ulps of each other and of the
    float64 block maximum (a sum of ~20 terms, some larger than the result, loses a few ulps
    in any order), and indices equal except on at most 1% of the elements, each within 1e-5
    (relative to its block's scale) of a midpoint of the code, where float32 summation order
    decides the side."""
    torch.testing.assert_close(got[1], want[1], rtol=2 ** -20, atol=0)
    block_max = exact.abs().reshape(-1, blocksize).amax(dim=1)
    torch.testing.assert_close(got[1].double(), block_max, rtol=2 ** -20, atol=0)
    numel = exact.numel()
    diff = _indices(got[0], numel) != _indices(want[0], numel)
    assert int(diff.sum()) <= numel // 100
    sorted_code = code.double().sort().values
    mids = (sorted_code[1:] + sorted_code[:-1]) / 2
    scale = want[1].double().repeat_interleave(blocksize)
    v = exact.reshape(-1)[diff] / scale[diff]
    assert bool(((v[:, None] - mids).abs().amin(dim=1) <= 1e-5).all())
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize(("blocksize", "config"), [(32, None), (64, None), (64, (16, 128, 4))])
def test_nearest_matches_reference(quant_type, blocksize, config):
    # 40 rows: three row tiles, the last one masked; 192 columns: with BN=128 a column tile
    # half past the end; with blocksize 32 two blocks per tile row.
    q, qs, up, down, seg = _case(40, 192, blocksize, quant_type)
    args = (q, qs.absmax, qs.code, (40, 192), blocksize, up, down, seg, SCALES)
    got = merge_4bit(*args, config=config)
    want = merge_4bit_reference(*args)
    _assert_same_up_to_midpoints(got, want, qs.code, _float64_merged(q, qs, up, down, seg, SCALES),
                                 blocksize)
    # and the merge did something: most indices moved
    assert int((_indices(got[0], 40 * 192) != _indices(q, 40 * 192)).sum()) > 40 * 192 // 2


def test_bf16_factors_match_reference():
    q, qs, up, down, seg = _case(24, 128, 64, "nf4", fdtype=torch.bfloat16, seed=1)
    args = (q, qs.absmax, qs.code, (24, 128), 64, up, down, seg, SCALES)
    _assert_same_up_to_midpoints(merge_4bit(*args), merge_4bit_reference(*args), qs.code,
                                 _float64_merged(q, qs, up, down, seg, SCALES), 64)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_zero_update_is_bitsandbytes_requantization(quant_type):
    """With scale 0 the kernel re-encodes the dequantized weight: bitsandbytes' own bytes."""
    q, qs, up, down, seg = _case(32, 128, 64, quant_type, seed=2)
    got = merge_4bit(q, qs.absmax, qs.code, (32, 128), 64, up, down, seg, [0.0, 0.0, 0.0])
    q2, qs2 = F.quantize_4bit(F.dequantize_4bit(q, qs), blocksize=64, quant_type=quant_type)
    assert torch.equal(got[1], qs2.absmax)
    if q.is_cuda and quant_type == "fp4":
        # bitsandbytes' CUDA FP4 encoder does not round every value to the nearest code, as
        # its CPU encoder and shuttle do (seen on the H200): compare with the reference path
        want = merge_4bit_reference(q, qs.absmax, qs.code, (32, 128), 64, up, down, seg,
                                    [0.0, 0.0, 0.0])
        assert torch.equal(got[0], want[0])
    else:
        assert torch.equal(got[0], q2)


def test_zero_block_keeps_zero_absmax():
    q, qs, up, down, seg = _case(16, 128, 64, "nf4", seed=3)
    up[:3] = 0  # rows 0-2 get no update ...
    absmax = qs.absmax.clone()
    absmax[:4] = 0  # ... and their first blocks are zero
    got = merge_4bit(q, absmax, qs.code, (16, 128), 64, up, down, seg, SCALES)
    want = merge_4bit_reference(q, absmax, qs.code, (16, 128), 64, up, down, seg, SCALES)
    assert torch.equal(got[1][:4], torch.zeros(4, device=DEVICE))
    # 4 blocks of 64 = rows 0-1: the code's zero, as the reference encodes them
    zero = int((qs.code == 0).nonzero()[0])
    assert bool((_indices(got[0], 256) == zero).all())
    assert torch.equal(_indices(got[0], 256), _indices(want[0], 256))


def _assert_stochastic_draws(got, exact, code, seed, blocksize):
    """``got`` ``(packed, absmax)`` is the stochastic encoding of ``exact`` (float64) with the
    draws ``hash_uniform(seed, flat index)``: absmax within 8 float32 ulps of the block maximum,
    and every index the upper neighbour of ``v = exact / absmax`` iff its draw ``u < p``, except
    where ``|u - p| <= 1e-4`` (float32 rounding of v decides; expected on ~2e-4 of the
    elements)."""
    block_max = exact.abs().reshape(-1, blocksize).amax(dim=1)
    torch.testing.assert_close(got[1].double(), block_max, rtol=2 ** -20, atol=0)
    numel = exact.numel()
    sorted_code, perm = code.double().sort()
    scale = got[1].double().repeat_interleave(blocksize)
    v = (exact.reshape(-1) / scale).clamp(-1, 1)
    hi = (sorted_code < v[:, None]).sum(dim=1).clamp(1, 15)
    lo = hi - 1
    p = (v - sorted_code[lo]) / (sorted_code[hi] - sorted_code[lo])
    u = hash_uniform(seed, torch.arange(numel, device=p.device)).double()  # the kernel's
    idx = _indices(got[0], numel)
    assert bool(((idx == perm[hi]) | (idx == perm[lo])).all()), "not a neighbour of v"
    wrong = (idx == perm[hi]) != (u < p)
    assert bool(((u - p)[wrong].abs() <= 1e-4).all()), f"{int(wrong.sum())} draws not u < p"
    assert int(wrong.sum()) <= max(3, numel // 1000)


def test_stochastic_repeatable_and_tiling_moves_only_float32_rounding():
    """Stochastic rounding repeats bit for bit for a seed and a tiling, and draws the same
    ``hash_uniform(seed, flat index)`` on any tiling. Another tiling may sum the low-rank
    products in another float32 order (``tl.dot`` follows the tile shape; NumPy's BLAS on
    AVX2 CPUs moved 5 absmax by one ulp here), so across tilings: absmax within a few ulps,
    codes equal except where a value lies at float32 rounding of its draw."""
    q, qs, up, down, seg = _case(40, 192, 64, "nf4", seed=4)
    args = (q, qs.absmax, qs.code, (40, 192), 64, up, down, seg, SCALES)
    exact = _float64_merged(q, qs, up, down, seg, SCALES)
    seed = 2 ** 62 + 5  # merge seeds are 63-bit
    results = []
    for config in [None, (32, 128, 4), (16, 256, 4)]:
        a = merge_4bit(*args, rounding="stochastic", seed=seed, config=config)
        again = merge_4bit(*args, rounding="stochastic", seed=seed, config=config)
        assert torch.equal(a[0], again[0]) and torch.equal(a[1], again[1])
        _assert_stochastic_draws(a, exact, qs.code, seed, 64)
        nearest = merge_4bit(*args, config=config)
        torch.testing.assert_close(a[1], nearest[1], rtol=0, atol=0)  # scales are deterministic
        results.append(a)
    for b in results[1:]:
        torch.testing.assert_close(b[1], results[0][1], rtol=2 ** -20, atol=0)
        moved = _indices(b[0], 40 * 192) != _indices(results[0][0], 40 * 192)
        assert int(moved.sum()) <= 40 * 192 // 1000
    c = merge_4bit(*args, rounding="stochastic", seed=seed + 1)
    assert not torch.equal(results[0][0], c[0])


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_stochastic_is_unbiased(quant_type):
    q, qs, up, down, seg = _case(16, 64, 32, quant_type, seed=5)
    args = (q, qs.absmax, qs.code, (16, 64), 32, up, down, seg, SCALES)
    exact = _float64_merged(q, qs, up, down, seg, SCALES)
    n = 96

    def dequantized(packed, absmax):
        qs.absmax = absmax
        return F.dequantize_4bit(packed, qs).double()

    mean = sum(dequantized(*merge_4bit(*args, rounding="stochastic", seed=s))
               for s in range(n)) / n
    nearest = dequantized(*merge_4bit(*args))
    # Each draw is one of two neighbours at most one code step apart (std <= step / 2): the
    # mean of n draws lies within 4 standard deviations of the exact value.
    sorted_code = qs.code.double().sort().values
    step = (sorted_code[1:] - sorted_code[:-1]).max() * qs.absmax.double().view(16, 2)
    step = step.repeat_interleave(32, dim=1)
    assert bool(((mean - exact).abs() <= 4 * step / (2 * n ** 0.5)).all())
    assert (mean - exact).abs().mean() < 0.3 * (nearest - exact).abs().mean()


@pytest.mark.parametrize("quant_storage", [torch.uint8, torch.bfloat16])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_representation_merge_is_encode(quant_storage, rounding):
    q, qs, up, down, seg = _case(40, 128, 64, "nf4", quant_storage=quant_storage, seed=6)
    p = bnb.nn.Params4bit(q, requires_grad=False, quant_state=qs, blocksize=64,
                          quant_type="nf4", quant_storage=quant_storage, bnb_quantized=True)
    rep = Bnb4bitWeight.from_tensor(p)
    got = rep.merge_lowrank(up, down, seg, SCALES, rounding=rounding, seed=11)
    update = sum(a * (up[:, seg[i]:seg[i + 1]].float() @ down[seg[i]:seg[i + 1]].float())
                 for i, a in enumerate(SCALES))
    want = rep.encode(rep.dequantize() + update, rounding, torch.Generator(DEVICE).manual_seed(1))
    assert isinstance(got, Bnb4bitWeight)
    assert {n: (t.shape, t.dtype) for n, t in got.tensors().items()} == {
        n: (t.shape, t.dtype) for n, t in want.tensors().items()}
    assert (got.shape, got.blocksize, got.quant_type, got.dtype) == (
        want.shape, want.blocksize, want.quant_type, want.dtype)
    exact = _float64_merged(q, qs, up, down, seg, SCALES)
    if rounding == "nearest":
        _assert_same_up_to_midpoints((got.packed, got.absmax), (want.packed, want.absmax),
                                     rep.code, exact, 64)
    else:  # other random streams: equal scales, and every value one of its two neighbours
        torch.testing.assert_close(got.absmax, want.absmax, rtol=2 ** -20, atol=0)
        sorted_code = rep.code.double().sort().values
        step = (sorted_code[1:] - sorted_code[:-1]).max() * got.absmax.double()
        err = (got.dequantize().double() - exact).abs().view(-1, 64)
        assert bool((err <= step.view(-1, 1) * (1 + 1e-5)).all())
    assert torch.equal(Bnb4bitWeight.from_tensor(got.to_parameter()).dequantize(),
                       got.dequantize())


def test_unsupported_forms_return_none(monkeypatch):
    up, down, seg = torch.randn(16, 2), torch.randn(2, 96), [0, 2]
    w = torch.randn(16, 96)
    q, qs = F.quantize_4bit(w[:, :64].to(DEVICE), blocksize=64, compress_statistics=True)
    nested = represent(bnb.nn.Params4bit(q, requires_grad=False, quant_state=qs, blocksize=64,
                                         compress_statistics=True, bnb_quantized=True))
    assert nested.nested
    assert nested.merge_lowrank(up.to(DEVICE), down[:, :64].to(DEVICE), seg, [1.0]) is None
    # 96 columns in blocks of 64: blocks straddle rows
    q, qs = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert merge_4bit(q, qs.absmax, qs.code, (16, 96), 64, up, down, seg, [1.0]) is None
    # CPU tensors without the interpreter: no kernel to run
    q, qs = F.quantize_4bit(w[:, :64].contiguous(), blocksize=64, quant_type="nf4")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert merge_4bit(q, qs.absmax, qs.code, (16, 64), 64, up, down[:, :64], seg, [1.0]) is None


def test_code_order_sorts_and_indexes_back_into_the_code():
    from shuttle.kernels.merge_nf4 import code_order

    code = torch.randn(16, generator=torch.Generator().manual_seed(3)).bfloat16()
    order = code_order(code)
    assert torch.equal(order.values, code.float())
    assert torch.equal(order.sorted, order.values[order.perm.long()])
    assert bool((order.sorted[1:] >= order.sorted[:-1]).all()) and order.perm.dtype == torch.int32


def test_a_code_is_ordered_once_until_it_changes(monkeypatch):
    """The 4-bit representation keeps one order per code tensor (shared by a model's weights),
    recomputed after the code is changed in place and dropped with the code."""
    import gc

    from shuttle.kernels import merge_nf4
    from shuttle.weights import bnb

    calls = []
    real = merge_nf4.code_order
    monkeypatch.setattr(merge_nf4, "code_order", lambda c: calls.append(1) or real(c))
    code = torch.linspace(-1, 1, 16)
    first = bnb._code_order(code)
    assert bnb._code_order(code) is first and len(calls) == 1
    code[0] = -2.0
    assert bnb._code_order(code).values[0] == -2.0 and len(calls) == 2
    n = len(bnb._ORDERS)
    del code, first
    gc.collect()
    assert len(bnb._ORDERS) == n - 1
