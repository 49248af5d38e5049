"""The fused LoRA linear's CuTe-DSL Hopper GEMM for one layer: where it runs, and (on the H200)
its results against the PyTorch reference and the Triton kernel.
"""

from __future__ import annotations

import pytest
import torch

from shuttle.kernels import lora_linear_fused_reference
from shuttle.kernels.cute_dsl import CUTE_TILES, PINGPONG_TILES
from shuttle.kernels.lora_linear_cute import CuteLoraGemm, cute_available, cute_installed
from tests.kernels.test_lora_linear import BF16, FP16, _assert_one_ulp, _layer

needs_dsl = pytest.mark.skipif(not cute_installed(), reason="nvidia-cutlass-dsl not installed")


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


def test_prepared_layer_with_cute_is_unusable_off_hopper():
    from shuttle.kernels import PreparedLoraLinear

    x, w, bias, down, up, scale = _layer(100, 64, 48, 8, BF16, BF16)
    prep = PreparedLoraLinear(w, bias, down, up, "fused_cute")
    assert not prep.usable and not prep.cute
    assert not CuteLoraGemm.supports(w, up)  # on the CPU


def test_a_kernel_that_cannot_be_built_leaves_the_layer_to_triton(monkeypatch):
    import shuttle.kernels.lora_linear_cute as mod
    from shuttle.kernels.lora_linear_tma import _cute_gemms

    x, w, bias, down, up, scale = _layer(100, 64, 48, 8, BF16, BF16)

    class Broken:
        supports = staticmethod(lambda weight, up, down=None, tile=None: True)

        def __init__(self, *args, **kwargs):
            raise RuntimeError("DSL: unsupported driver")
    monkeypatch.setattr(mod, "cute_available", lambda device=None: True)
    monkeypatch.setattr(mod, "CuteLoraGemm", Broken)
    with pytest.warns(RuntimeWarning, match="unsupported driver.*Triton"):
        assert _cute_gemms(w, bias, down, up, CUTE_TILES) == {}
    monkeypatch.setattr(Broken, "supports",
                        staticmethod(lambda weight, up, down=None, tile=None: False))
    assert _cute_gemms(w, bias, down, up, CUTE_TILES) == {}  # not taken: no warning, no build


def tile_id(tile):
    """A CuTe tile's test id: its shape, and whether it is a ping-pong tile."""
    return f"{tile.m}x{tile.n}" + ("-pingpong" if tile.pingpong else "")


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("tile", CUTE_TILES + PINGPONG_TILES, ids=tile_id)
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
        gemm = CuteLoraGemm(w, up, b is not None, tile)
        out = torch.full((t, n), float("nan"), dtype=dtype, device="cuda")
        gemm(x, w, b, s, out)
        torch.cuda.synchronize()
        _assert_one_ulp(out, lora_linear_fused_reference(x, w, b, s, up))
    # the bias written in place is seen by the next call (its version moved)
    gemm = CuteLoraGemm(w, up, True, tile)
    out = torch.empty(t, n, dtype=dtype, device="cuda")
    gemm(x, w, bias, s, out)
    with torch.no_grad():
        bias.add_(1.0)
    gemm(x, w, bias, s, out)
    _assert_one_ulp(out, lora_linear_fused_reference(x, w, bias, s, up))


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("tile", [CUTE_TILES[0], PINGPONG_TILES[0]], ids=tile_id)
def test_a_dependent_gemm_reads_s_and_the_bias_once_the_kernel_before_it_ended(tile):
    """Built with pdl, the GEMM starts while the kernel before it runs (late_copy, writing S a
    millisecond after letting it start) and reads S only after that kernel's end: the result
    is the ordinary launch's, bit for bit. Its bias copy, refreshed by a kernel right before
    the GEMM, is waited for too."""
    from tests.kernels.test_launch import late_copy

    if not cute_available():
        pytest.skip("needs an sm_90 GPU")
    t, k, n, r = 1000, 1536, 1536, 64
    x, w, bias, down, up, scale = _layer(t, k, n, r, BF16, BF16, device="cuda")
    s = ((x.float() @ down.float().T) * scale).to(BF16)
    plain, dependent = (CuteLoraGemm(w, up, True, tile, pdl=pdl) for pdl in (False, True))
    want, got = (torch.empty(t, n, dtype=BF16, device="cuda") for _ in range(2))
    plain(x, w, bias, s, want)
    dependent(x, w, bias, s, got)  # compiled and its bias copied before the timed launch
    s_late = torch.zeros_like(s)
    late_copy(s, s_late)
    dependent(x, w, bias, s_late, got)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    with torch.no_grad():
        bias.add_(1.0)  # the next call copies it by a kernel between late_copy and the GEMM
    plain(x, w, bias, s, want)
    s_late.zero_()
    late_copy(s, s_late)
    dependent(x, w, bias, s_late, got)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def _ulp(v):
    """The larger gap to v's two neighbours, in float64."""
    return torch.maximum(*((torch.nextafter(v, torch.full_like(v, inf)).double()
                            - v.double()).abs() for inf in (torch.inf, -torch.inf)))


def _assert_within_s_rounding(got, x, w, bias, down, up, scale):
    """``got`` is the fused layer with S computed in the kernel: S's float32 accumulation may
    round a few of its elements to the neighbouring value, so each output may differ from the
    reference by one ulp of its own plus what one ulp of every S element moves it by."""
    s_low = ((x.double() @ down.double().T) * scale.double()).to(got.dtype)
    want = lora_linear_fused_reference(x, w, bias, s_low, up)
    bound = _ulp(want) + _ulp(s_low) @ up.double().abs().T + 1e-5 * float(want.abs().max())
    diff = (got.double() - want.double()).abs()
    assert bool((diff <= bound).all()), float((diff / bound).max())


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("tile", CUTE_TILES + PINGPONG_TILES, ids=tile_id)
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize(("t", "k", "n", "r"), [
    (300, 200, 136, 24), (4096, 1536, 1536, 128), (129, 64, 520, 8),
    (1000, 320, 1000, 64),  # an odd count of row tiles: the last S tile covers one
    (20000, 256, 4096, 16)])  # many S tiles, read ahead of their rows
def test_gpu_the_shrink_form_matches_reference(tile, dtype, t, k, n, r):
    """The kernel computing S among its units: partial tiles everywhere; three calls in a row
    on new inputs (each call's readers reset the flags for the next); the scale written in
    place is seen by the next call."""
    if not cute_available():
        pytest.skip("needs an sm_90 GPU")
    x, w, bias, down, up, scale = _layer(t, k, n, r, dtype, dtype, device="cuda")
    for b in (bias, None):
        gemm = CuteLoraGemm(w, up, b is not None, tile, down)
        assert gemm.shrink
        for seed in range(3):
            xi = x if seed == 0 else torch.randn_like(x)
            out = torch.full((t, n), float("nan"), dtype=dtype, device="cuda")
            gemm(xi, w, b, scale, out)
            torch.cuda.synchronize()
            _assert_within_s_rounding(out, xi, w, b, down, up, scale)
    assert not gemm._lists.flags.any()  # reset by each S tile's last reader
    with torch.no_grad():
        scale.mul_(-2.0)
    gemm(x, w, None, scale, out)
    _assert_within_s_rounding(out, x, w, None, down, up, scale)


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("tile", CUTE_TILES + PINGPONG_TILES, ids=tile_id)
def test_gpu_the_shrink_form_replays_in_a_cuda_graph(tile):
    """Captured once, replayed on new inputs: the flags a replay finds are the zeros the last
    one left (with 128 x 192 tiles, S tiles read by row tiles straddling two)."""
    if not cute_available():
        pytest.skip("needs an sm_90 GPU")
    x, w, bias, down, up, scale = _layer(5000, 512, 1536, 32, BF16, BF16, device="cuda")
    gemm = CuteLoraGemm(w, up, True, tile, down)
    out = torch.empty(5000, 1536, dtype=BF16, device="cuda")
    gemm(x, w, bias, scale, out)  # the work list made, the program loaded
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(x, w, bias, scale, out)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        _assert_within_s_rounding(out, x, w, bias, down, up, scale)
    # a row count first seen during a capture: no work list is made there; the kernel
    # launches nothing and the prepared layer runs Triton's kernels for that call
    from shuttle.kernels import PreparedLoraLinear

    prep = PreparedLoraLinear(w, bias, down, up, "fused_cute_shrink")
    assert prep.cute and all(g.shrink for g in prep._cute.values())
    x2 = torch.randn(3001, 512, dtype=BF16, device="cuda")
    PreparedLoraLinear(w, bias, down, up)(x2, scale)  # Triton's kernels compiled, not captured
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert gemm(x2, w, bias, scale, torch.empty(3001, 1536, dtype=BF16,
                                                    device="cuda")) is None
        got = prep(x2, scale)
    graph.replay()
    torch.cuda.synchronize()
    _assert_within_s_rounding(got, x2, w, bias, down, up, scale)


@pytest.mark.gpu
@needs_dsl
def test_gpu_prepared_cute_layer_agrees_with_triton():
    from shuttle.kernels import PreparedLoraLinear
    from shuttle.kernels.lora_shrink import launch_short_shrink

    if not cute_available():
        pytest.skip("needs an sm_90 GPU")
    x, w, bias, down, up, scale = _layer(4096, 1536, 1536, 64, BF16, BF16, device="cuda")
    cute = PreparedLoraLinear(w, bias, down, up, "fused_cute_shrink")
    triton = PreparedLoraLinear(w, bias, down, up)
    assert cute.usable and cute.cute and triton.usable and not triton.cute
    with torch.no_grad():
        _assert_within_s_rounding(cute(x, scale), x, w, bias, down, up, scale)
        _assert_within_s_rounding(triton(x, scale), x, w, bias, down, up, scale)
    # the ping-pong tile (after Triton's shrink): the cooperative 128 x 192 tile's bits
    pong = PreparedLoraLinear(w, bias, down, up, "fused_cute_pingpong")
    coop = CuteLoraGemm(w, up, True, CUTE_TILES[1])
    assert pong.cute and [tile.pingpong for tile in pong._cute] == [True]
    with torch.no_grad():
        got = pong(x, scale)
        s = torch.empty(4096, 64, dtype=BF16, device="cuda")
        launch_short_shrink(x, down, scale, s)
        want = coop(x, w, bias, s, torch.empty_like(got))
    assert torch.equal(got, want)
    # past 128 ranks the kernel takes S from Triton's shrink
    x, w, bias, down, up, scale = _layer(4096, 512, 1536, 136, BF16, BF16, device="cuda")
    wide = PreparedLoraLinear(w, bias, down, up, "fused_cute_shrink")
    assert wide.cute and not any(g.shrink for g in wide._cute.values())
    with torch.no_grad():
        _assert_within_s_rounding(wide(x, scale), x, w, bias, down, up, scale)


def _ffi_layer(t, k, n, r):
    """x, W, bias, S (the shrink's output) and B of a bf16 layer, where the TVM FFI launch can
    run (else the test is skipped)."""
    from shuttle.kernels import lora_linear_cute

    if not cute_available():
        pytest.skip("needs an sm_90 GPU")
    if not lora_linear_cute.tvm_ffi_installed():
        pytest.skip("needs apache-tvm-ffi (the hopper extra)")
    x, w, bias, down, up, scale = _layer(t, k, n, r, BF16, BF16, device="cuda")
    return x, w, bias, ((x.float() @ down.float().T) * scale).to(BF16), up


@pytest.mark.gpu
@needs_dsl
def test_gpu_tvm_ffi_launch_equals_the_dsl_launcher(monkeypatch):
    """Where apache-tvm-ffi is installed the kernel launches through its C function (integer
    addresses, the stream's handle); the DSL's own launcher gives the same bits, also on a side
    stream (the launch takes the current stream)."""
    from shuttle.kernels import lora_linear_cute

    x, w, bias, s, up = _ffi_layer(4096, 1536, 1536, 64)
    ffi = CuteLoraGemm(w, up, True)
    monkeypatch.setattr(lora_linear_cute, "tvm_ffi_installed", lambda: False)
    dsl_launch = CuteLoraGemm(w, up, True)
    assert ffi._ffi is not None and dsl_launch._ffi is None
    want = dsl_launch(x, w, bias, s, torch.empty(4096, 1536, dtype=BF16, device="cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = ffi(x, w, bias, s, torch.full((4096, 1536), float("nan"), dtype=BF16,
                                            device="cuda"))
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)


@pytest.mark.gpu
@needs_dsl
def test_gpu_a_refused_tvm_ffi_launch_falls_back_to_the_dsl_launcher():
    """An FFI that refuses the arguments (a version the DSL's program does not take) costs one
    warning, then the DSL's own launcher serves every call: the same bits."""
    x, w, bias, s, up = _ffi_layer(1024, 512, 512, 16)
    gemm = CuteLoraGemm(w, up, True)
    want = gemm(x, w, bias, s, torch.empty(1024, 512, dtype=BF16, device="cuda")).clone()

    def refuse(*args):
        raise TypeError("an argument the function does not take")
    gemm._ffi = refuse
    with pytest.warns(RuntimeWarning, match="TVM FFI launch failed"):
        got = gemm(x, w, bias, s, torch.empty(1024, 512, dtype=BF16, device="cuda"))
    assert gemm._ffi is None and torch.equal(got, want)
