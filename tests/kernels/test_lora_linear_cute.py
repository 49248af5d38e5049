"""The CuTe-DSL Hopper GEMM of the fused LoRA linear.

On the CPU the DSL still compiles the kernel for sm_90a (no GPU needed to build it), so these
tests check the program it emits: the warpgroup MMA at the tile's shape, one producer warpgroup
beside the consumers, five TMA descriptors (x, W, S, B and the output), the bias read only where
asked. The ``gpu`` tests run it on the H200 against its PyTorch reference and the Triton kernel.
"""

from __future__ import annotations

import re

import pytest
import torch

from shuttle.kernels import lora_linear_fused_reference
from shuttle.kernels.lora_linear_cute import (
    CUTE_TILES,
    CuteLoraGemm,
    compile_lora_gemm,
    cute_available,
    cute_installed,
)
from tests.kernels.test_lora_linear import BF16, FP16, _assert_one_ulp, _layer

needs_dsl = pytest.mark.skipif(not cute_installed(), reason="nvidia-cutlass-dsl not installed")


@pytest.fixture(scope="module")
def ptx_of(tmp_path_factory):
    """The PTX of a compile (the DSL writes it under a dump folder: a temporary one here)."""
    options = f"--keep-ptx --dump-dir {tmp_path_factory.mktemp('cute')}"

    def ptx(dtype, tile, bias) -> str:
        return str(compile_lora_gemm(dtype, tile, bias, 132, options).artifacts.PTX)
    return ptx


@needs_dsl
@pytest.mark.parametrize("tile", CUTE_TILES, ids=lambda t: f"{t.m}x{t.n}")
@pytest.mark.parametrize(("dtype", "ptx_type"), [(BF16, "bf16"), (FP16, "f16")])
def test_compiles_for_hopper_on_the_cpu(tile, dtype, ptx_type, ptx_of):
    ptx = ptx_of(dtype, tile, bias=True)
    assert ".target sm_90a" in ptx
    # float32 accumulation of 16-bit operands at the tile's width, 64 rows per instruction
    mmas = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+)\.(\w+)\.(\w+)\.(\w+)", ptx))
    assert mmas == {(f"m64n{tile.n}k16", "f32", ptx_type, ptx_type)}
    # a producer warpgroup beside the consumer warpgroups, registers moved between them
    assert f".reqntid {128 * (1 + tile.consumers)}, 1, 1" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    # x, W, S, B loaded and the output stored by TMA: five 128-byte descriptors
    assert len(re.findall(r"\.param \.align 64 \.b8 \w+\[128\]", ptx)) == 5
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx


@needs_dsl
def test_the_bias_is_read_only_when_the_layer_has_one(ptx_of):
    tile = CUTE_TILES[0]
    with_bias, without = ptx_of(BF16, tile, True), ptx_of(BF16, tile, False)
    assert re.search(r"\bld\.global[.\w]*", with_bias)
    assert not re.search(r"\bld\.global[.\w]*", without)


def test_without_the_extra_or_off_hopper_the_kernel_is_unavailable(monkeypatch):
    import shuttle.kernels.lora_linear_cute as mod

    monkeypatch.setattr(mod, "cute_installed", lambda: False)
    mod._available_on.cache_clear()
    try:
        assert not mod._available_on(0)  # whatever device 0 is
    finally:
        mod._available_on.cache_clear()
    if not torch.cuda.is_available():
        assert not mod.cute_available()


def test_a_missing_dsl_names_the_extra(monkeypatch):
    import sys

    from shuttle.errors import MissingDependencyError
    from shuttle.kernels.lora_linear_cute import _dsl

    monkeypatch.setitem(sys.modules, "cutlass", None)  # import cutlass -> ImportError
    with pytest.raises(MissingDependencyError, match=r"shuttle\[hopper\]"):
        _dsl.__wrapped__()


def test_prepared_layer_with_cute_is_unusable_off_hopper():
    from shuttle.kernels import PreparedLoraLinear

    x, w, bias, down, up, scale = _layer(100, 64, 48, 8, BF16, BF16)
    prep = PreparedLoraLinear(w, bias, down, up, cute=True)
    assert not prep.usable and prep.cute
    assert not CuteLoraGemm.supports(w, up)  # on the CPU


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("tile", CUTE_TILES, ids=lambda t: f"{t.m}x{t.n}")
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize(("t", "k", "n", "r"), [(300, 200, 136, 24), (4096, 1536, 1536, 128),
                                                (129, 64, 520, 8)])
def test_gpu_matches_reference(tile, dtype, t, k, n, r):
    """Partial tiles in every dimension (rows, K and R past a 64-wide step, N past a tile)."""
    if not cute_available():
        pytest.skip("needs an sm_90 GPU")
    x, w, bias, down, up, scale = _layer(t, k, n, r, dtype, dtype, device="cuda")
    s = ((x.float() @ down.float().T) * scale).to(dtype)
    for b in (bias, None):
        gemm = CuteLoraGemm(w, b, up, tile)
        out = torch.full((t, n), float("nan"), dtype=dtype, device="cuda")
        gemm(x, s, out)
        torch.cuda.synchronize()
        _assert_one_ulp(out, lora_linear_fused_reference(x, w, b, s, up))


@pytest.mark.gpu
@needs_dsl
def test_gpu_prepared_cute_layer_agrees_with_triton():
    from shuttle.kernels import PreparedLoraLinear

    if not cute_available():
        pytest.skip("needs an sm_90 GPU")
    x, w, bias, down, up, scale = _layer(4096, 1536, 1536, 64, BF16, BF16, device="cuda")
    cute = PreparedLoraLinear(w, bias, down, up, cute=True)
    triton = PreparedLoraLinear(w, bias, down, up)
    assert cute.usable and triton.usable
    with torch.no_grad():
        _assert_one_ulp(cute(x, scale), triton(x, scale))
