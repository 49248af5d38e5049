"""Stochastic rounding by bit stepping: neighbours, unbiasedness, repeatability."""

from __future__ import annotations

import math

import pytest
import torch

from shuttle.apply.rounding import stochastic_round as nextafter_round
from shuttle.kernels.rounding import round_float, stochastic_round

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# (mantissa bits, exponent of the smallest normal)
_LAYOUT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def fp8_gap(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 distance between the two float8 values around ``v`` (its step)."""
    mant, emin = _LAYOUT[dtype]
    a = v.double().abs()
    e = torch.where(a > 0, torch.floor(torch.log2(torch.where(a > 0, a, 1.0))),
                    torch.full_like(a, emin))
    return torch.exp2(torch.clamp(e, min=emin) - mant)


def sample(dtype: torch.dtype, n: int = 256) -> torch.Tensor:
    """float32 values of both signs across normal and subnormal float8 ranges, plus edges."""
    g = torch.Generator().manual_seed(1)
    fmax = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    mag = torch.exp(torch.empty(n).uniform_(math.log(tiny / 8), math.log(fmax / 2), generator=g))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    edges = torch.tensor([0.0, -0.0, fmax, -fmax, tiny, -tiny, tiny / 16, -tiny / 16])
    return torch.cat([mag * sign, edges])


@pytest.mark.parametrize("dtype", FP8)
def test_result_is_a_neighbour(dtype):
    x = sample(dtype)
    r = stochastic_round(x, dtype, torch.Generator().manual_seed(0)).double()
    gap = fp8_gap(x, dtype)
    assert r.dtype == torch.float64 and torch.isfinite(r).all()
    assert ((r - x.double()).abs() < gap).all()
    # exact values stay exact
    exact = x.to(dtype)
    assert torch.equal(stochastic_round(exact.float(), dtype).view(torch.uint8),
                       exact.view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
def test_unbiased_over_seeds(dtype):
    x = sample(dtype)
    seeds = 400
    total = torch.zeros_like(x, dtype=torch.float64)
    for s in range(seeds):
        total += stochastic_round(x, dtype, torch.Generator().manual_seed(s)).double()
    mean = total / seeds
    gap = fp8_gap(x, dtype)
    # Each draw is one of two values gap apart: std of the mean <= gap / (2 sqrt(seeds));
    # allow 5 of those.
    tol = 5 * gap / (2 * math.sqrt(seeds))
    assert ((mean - x.double()).abs() <= tol).all()
    # nearest rounding is biased on these inputs, so the test can tell the two apart
    near = x.to(dtype).double()
    assert ((near - x.double()).abs() > tol).any()


@pytest.mark.parametrize("dtype", FP8 + [torch.bfloat16, torch.float16])
def test_repeatable_for_a_seed(dtype):
    x = sample(torch.float8_e5m2).clamp(-60000, 60000)
    a = stochastic_round(x, dtype, torch.Generator().manual_seed(7))
    b = stochastic_round(x, dtype, torch.Generator().manual_seed(7))
    c = stochastic_round(x, dtype, torch.Generator().manual_seed(8))
    # by bits: x exceeds e4m3fn's range, whose cast gives NaN (NaN != NaN) in some torch builds
    bits = torch.uint8 if a.element_size() == 1 else torch.int16
    assert torch.equal(a.view(bits), b.view(bits))
    assert not torch.equal(a.view(bits), c.view(bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_nextafter_rounding_for_16_bit_floats(dtype):
    x = torch.randn(4096) * torch.logspace(-10, 4, 4096)
    x[:4] = torch.tensor([0.0, -0.0, 1.0, 1e-30])
    a = stochastic_round(x, dtype, torch.Generator().manual_seed(3))
    b = nextafter_round(x, dtype, torch.Generator().manual_seed(3))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_round_float_nearest_and_wide_targets():
    x = torch.randn(64)
    assert torch.equal(round_float(x, torch.bfloat16), x.bfloat16())
    assert torch.equal(round_float(x, torch.float32, "stochastic"), x)


# -- draws by element index ------------------------------------------------------------------

hash_uniform_tile = None  # tiles.hash_uniform, bound when the kernel is built (interpreter)


def _draw_kernel():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from shuttle.kernels import tiles

    globals()["hash_uniform_tile"] = tiles.hash_uniform

    @triton.jit
    def draw(idx_ptr, out_ptr, seed, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        idx = tl.load(idx_ptr + offs, mask=mask, other=0)
        tl.store(out_ptr + offs, hash_uniform_tile(seed, idx), mask=mask)

    return draw


def test_hash_uniform_is_the_kernels_draw_bit_for_bit():
    from shuttle.kernels.launch import seed32
    from shuttle.kernels.rounding import hash_uniform

    kernel = _draw_kernel()
    idx = torch.tensor([0, 1, 2, 255, 2**31 - 1, 2**31, 2**32 + 7, 2**40 + 123456789],
                       dtype=torch.int64)
    for seed in (0, 5, 2**62 + 5):
        out = torch.empty(idx.numel(), dtype=torch.float32)
        kernel[(1,)](idx, out, seed32(seed), idx.numel(), BLOCK=8)
        assert torch.equal(hash_uniform(seed, idx), out), seed


def test_global_draws_of_a_window_are_the_whole_tensors_draws_there():
    from shuttle.kernels.rounding import GlobalDraws, hash_uniform

    whole = hash_uniform(11, torch.arange(7 * 5 * 3).reshape(7, 5, 3))
    window = GlobalDraws(11, (2, 1, 0), (7, 5, 3)).uniform((4, 3, 3), "cpu")
    assert torch.equal(window, whole[2:6, 1:4, 0:3])
    assert float(whole.min()) >= 0.0 and float(whole.max()) < 1.0
    assert abs(float(whole.mean()) - 0.5) < 0.1


def test_stochastic_round_takes_its_draws_from_noise():
    x = torch.full((64,), 1.0 + 2**-9, dtype=torch.float32)  # a quarter of a bf16 step above 1
    low = torch.full((64,), 0.9)
    high = torch.full((64,), 0.1)
    assert torch.equal(stochastic_round(x, torch.bfloat16, noise=low), x.to(torch.bfloat16))
    up = stochastic_round(x, torch.bfloat16, noise=high)
    assert bool((up.float() > x).all())
