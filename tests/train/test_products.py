"""train.products: the factors cast in one launch whatever their number, scaled products
written into column windows, float32 gradients from bf16 operands, base products and adapted
products (the base GEMM accumulated into the expand)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shuttle.train import frozen_linear
from shuttle.train.products import (
    adapted_product,
    base_product,
    compute_factors,
    grad_mm,
    scaled_mm,
)
from tests.train import linear

_NO_KERNEL = ("aten.view", "aten.reshape", "aten._reshape_alias", "aten.slice", "aten.t.",
              "aten.transpose", "aten.split", "aten.detach", "aten.as_strided", "aten.alias",
              "aten.empty", "aten.new_empty", "aten._unsafe_view", "aten.expand", "aten.permute")


class _Launches(TorchDispatchMode):
    """Counts the aten ops that run a kernel (views and allocations excluded)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not str(func).startswith(_NO_KERNEL):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _factors(dtype, k=24):
    """Three adapters' factors; ``k``: the input width (8192: each A past one multi-tensor
    chunk's quarter, the cast goes by ``cat``)."""
    g = torch.Generator().manual_seed(0)
    a_list = [torch.randn(r, k, generator=g, dtype=dtype) for r in (4, 2, 3)]
    b_list = [torch.randn(n, r, generator=g, dtype=dtype) for n, r in ((16, 4), (8, 2), (8, 3))]
    return a_list, b_list


def _check_cast(a_list, b_list, a_all, bs):
    assert torch.equal(a_all, torch.cat(a_list).to(torch.bfloat16))
    assert a_all.is_contiguous() and a_all.shape == (sum(a.shape[0] for a in a_list),
                                                      a_list[0].shape[1])
    for b, got in zip(b_list, bs, strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == b.shape
        assert torch.equal(got, b.to(torch.bfloat16))


@pytest.mark.parametrize("k, launches_expected", [
    (24, {"aten._foreach_copy_.default": 1}),
    (8192, {"aten.cat.default": 1, "aten._to_copy.default": 1}),
])
def test_factors_of_another_dtype_are_cast_in_one_or_two_launches(k, launches_expected):
    a_list, b_list = _factors(torch.float32, k)
    with _Launches() as launches:
        a_all, bs = compute_factors(torch.bfloat16, a_list, b_list)
    assert dict(launches.ops) == launches_expected, launches.ops
    _check_cast(a_list, b_list, a_all, bs)
    one, (b0,) = compute_factors(torch.bfloat16, a_list[:1], b_list[:1])
    _check_cast(a_list[:1], b_list[:1], one, [b0])
    none, only_b = compute_factors(torch.bfloat16, [], b_list)
    assert none is None
    for b, got in zip(b_list, only_b, strict=True):
        assert torch.equal(got, b.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("k, kernels_expected", [(24, 1), (8192, 2)])
def test_factors_of_another_dtype_are_cast_by_one_or_two_kernels_on_cuda(k, kernels_expected):
    from torch.profiler import ProfilerActivity, profile

    a_list, b_list = _factors(torch.float32, k)
    a_list, b_list = [a.cuda() for a in a_list], [b.cuda() for b in b_list]
    compute_factors(torch.bfloat16, a_list, b_list)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        a_all, bs = compute_factors(torch.bfloat16, a_list, b_list)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == kernels_expected, kernels
    _check_cast([a.cpu() for a in a_list], [b.cpu() for b in b_list], a_all.cpu(),
                [b.cpu() for b in bs])


def test_factors_in_the_compute_dtype_are_used_as_they_are():
    a_list, b_list = _factors(torch.bfloat16)
    a_all, bs = compute_factors(torch.bfloat16, a_list, b_list)
    assert torch.equal(a_all, torch.cat(a_list))
    assert all(got is b for got, b in zip(bs, b_list, strict=True))
    one, _ = compute_factors(torch.bfloat16, a_list[:1], [])
    assert one is a_list[0]
    none, only_b = compute_factors(torch.bfloat16, [], b_list[:1])
    assert none is None and only_b[0] is b_list[0]


def test_a_scaled_product_lands_in_its_column_window_only():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, 5, generator=g), torch.randn(5, 3, generator=g)
    buf = torch.full((6, 8), 7.0)
    out = scaled_mm(a, b, 0.5, out=buf[:, 2:5])
    assert out.data_ptr() == buf[:, 2:5].data_ptr()
    torch.testing.assert_close(buf[:, 2:5], 0.5 * (a @ b))
    assert (buf[:, :2] == 7).all() and (buf[:, 5:] == 7).all()
    torch.testing.assert_close(scaled_mm(a, b, 2.0), 2 * (a @ b))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_gradient_comes_back_in_the_parameters_dtype(device):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(16, 512, generator=g).to(device, torch.bfloat16)
    b = torch.randn(512, 4, generator=g).to(device, torch.bfloat16)
    want = 0.7 * (a.double() @ b.double())
    got = grad_mm(a, b, 0.7, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (16, 4)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    # CUDA: the float32 accumulator itself (no bf16 rounding); elsewhere a bf16 product cast
    assert err < (1e-5 if device == "cuda" else 1e-2)


def test_the_base_product_is_the_linear_layer():
    for bias in (False, True):
        layer = linear(12, 7, torch.float64, bias=bias)
        x = torch.randn(5, 12, dtype=torch.float64)
        torch.testing.assert_close(base_product(x, frozen_linear(layer)), layer(x))


def test_an_adapted_product_adds_the_base_gemm_into_the_expand():
    g = torch.Generator().manual_seed(3)
    for bias in (False, True):
        layer = linear(12, 7, torch.float64, bias=bias)
        x = torch.randn(5, 12, generator=g, dtype=torch.float64)
        h = torch.randn(5, 3, generator=g, dtype=torch.float64)
        b = torch.randn(7, 3, generator=g, dtype=torch.float64)
        with _Launches() as launches:
            got = adapted_product(x, frozen_linear(layer), h, b, 0.25)
        torch.testing.assert_close(got, layer(x) + 0.25 * h @ b.T)
        # two GEMMs, the base one last and in place: no separate add of the expand
        ops = [op.split(".")[1] for op in launches.ops]
        assert ops == ["addmm", "addmm_"] and sum(launches.ops.values()) == 2, launches.ops
