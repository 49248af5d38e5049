"""The Hopper LoRA linear kernel (TMA tiles, persistent programs) as shrink and as fused linear,
and PreparedLoraLinear, against the PyTorch references.

On CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest) when asked for (``tma=True``);
the ``gpu`` tests compile it on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from shuttle.kernels import (
    lora_linear_fused,
    lora_linear_fused_reference,
    lora_shrink,
    lora_shrink_reference,
    triton_available,
)
from tests.kernels.test_lora_linear import BF16, FP16, _assert_one_ulp, _layer

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize(("t", "k", "n", "r"), [(70, 40, 96, 24), (33, 64, 48, 8)])
def test_tma_kernel_matches_reference(t, k, n, r, dtype):
    """The Hopper kernel (TMA tiles, persistent programs), as shrink and as fused linear; the
    shapes leave partial edge tiles in every dimension (rows 16-byte aligned, as TMA needs)."""
    x, w, bias, down, up, scale = _layer(t, k, n, r, dtype, dtype)
    s = lora_shrink(x, down, scale, tma=True)
    _assert_one_ulp(s, lora_shrink_reference(x, down, scale))
    for b in (bias, None):
        got = lora_linear_fused(x, w, b, s, up, config=(32, 32, 16, 16, 2, 1, 1), tma=True)
        _assert_one_ulp(got, lora_linear_fused_reference(x, w, b, s, up))


@pytest.mark.gpu
def test_gpu_compiled_launches_equal_tritons_dispatch():
    # The TMA kernel's later launches skip Triton's dispatch (launch.CompiledLaunch): same
    # binary, so the same bits, at other sizes than the launch that compiled it.
    from shuttle.kernels.lora_linear_tma import _kernel

    run = _kernel()
    for t in (100, 4096, 77, 100):
        x, w, bias, down, up, scale = _layer(t, 512, 384, 32, BF16, BF16, device="cuda")
        run.direct = False
        want_s = lora_shrink(x, down, scale)
        want = lora_linear_fused(x, w, bias, want_s, up)
        run.direct = True
        for _ in range(2):
            s = lora_shrink(x, down, scale)
            assert torch.equal(s, want_s)
            assert torch.equal(lora_linear_fused(x, w, bias, s, up), want)
    assert run.direct and run._binaries


def test_prepared_layer_needs_cuda_and_tracks_its_operands():
    from shuttle.kernels import PreparedLoraLinear

    x, w, bias, down, up, scale = _layer(100, 64, 48, 16, BF16, BF16, device="cpu")
    prep = PreparedLoraLinear(w, bias, down, up)
    assert not prep.usable  # the Hopper path is CUDA's (the interpreter takes the functions)
    assert prep.fits(w, bias)
    assert not prep.fits(w.clone(), bias) and not prep.fits(w, None)
    w.data = w.data.clone()  # as offloading swaps storage: same object, another address
    assert not prep.fits(w, bias)


@pytest.mark.gpu
def test_gpu_prepared_layer_is_the_functions_bit_for_bit():
    from shuttle.kernels import PreparedLoraLinear

    # a short x (lora_shrink's pointer kernel) and a wide one (its TMA kernel)
    for k in (4160, 512):
        x, w, bias, down, up, scale = _layer(300, k, 384, 32, BF16, BF16, device="cuda")
        prep = PreparedLoraLinear(w, bias, down, up)
        assert prep.usable and prep.fits(w, bias)
        want = lora_linear_fused(x, w, bias, lora_shrink(x, down, scale), up)
        for _ in range(2):  # the second launch of each kernel: its compiled binary
            assert torch.equal(prep(x, scale), want)
    # x that the Hopper path does not take: the caller uses the functions.
    assert prep(x[:64], scale) is None  # few rows
    assert prep(x.half(), scale) is None
    assert prep(torch.randn(300, 513, device="cuda").bfloat16()[:, 1:], scale) is None  # rows
    assert prep(x, scale.bfloat16()) is None
    with torch.enable_grad():
        assert prep(x.clone().requires_grad_(), scale) is None
    # Operands it cannot take at all.
    assert not PreparedLoraLinear(w, bias, down.float(), up.float()).usable
    shifted = torch.empty(w.numel() + 8, dtype=BF16, device="cuda")[1:1 + w.numel()]
    assert not PreparedLoraLinear(shifted.view_as(w), bias, down, up).usable  # misaligned
    del w
    assert prep(x, scale) is None  # the weight it was built for is gone


@pytest.mark.gpu
def test_gpu_the_gemm_as_a_dependent_reads_s_once_the_kernel_before_it_ended():
    """Launched as the shrink's programmatic dependent (as after the short shrink), the GEMM
    starts while the kernel before it runs (late_copy, writing S a millisecond after letting
    it start) and reads S after that kernel's end: the ordered launch's output, bit for bit."""
    from shuttle.kernels.launch import dependent_launch, sm_count
    from shuttle.kernels.lora_linear_tma import FUSED_TMA_CONFIG, _launch_tma, _tma_constexprs
    from shuttle.kernels.tma import ensure_allocator
    from tests.kernels.test_launch import late_copy

    if not dependent_launch(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs sm_90 and a Triton with it")
    t, k, n, r = 300, 512, 384, 32
    x, w, bias, down, up, scale = _layer(t, k, n, r, BF16, BF16, device="cuda")
    s = lora_shrink(x, down, scale)
    ensure_allocator()
    ordered, dependent = (_tma_constexprs(FUSED_TMA_CONFIG, n, r, True, False, BF16, True, pdl)
                          for pdl in (False, True))
    assert dependent["launch_pdl"] and not ordered["launch_pdl"]
    want, got = (torch.empty(t, n, dtype=BF16, device="cuda") for _ in range(2))
    sms = sm_count(torch.cuda.current_device())
    _launch_tma(x, w, s, up, bias, None, want, sms, ordered)
    _launch_tma(x, w, s, up, bias, None, got, sms, dependent)  # compiled before the timed launch
    s_late = torch.zeros_like(s)
    late_copy(s, s_late)
    _launch_tma(x, w, s_late, up, bias, None, got, sms, dependent)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_fused_tiles_narrow_where_wide_ones_fill_the_sms_poorly():
    from shuttle.kernels.lora_linear_tma import (
        FUSED_TMA_CONFIG,
        FUSED_TMA_NARROW_CONFIG,
        fused_tma_config,
    )

    # On 132 SMs (the H200), the demo DiT at 4096 rows: 1536 wide -> 192 tiles of 128 x 256,
    # 73% of two rounds: narrow; 4608 and 6144 wide -> 87% and 97%: wide. Wan2.1 at 32760
    # rows, 1536 wide: 1536 tiles, 97%.
    assert fused_tma_config(4096, 1536, 132) == FUSED_TMA_NARROW_CONFIG
    assert fused_tma_config(4096, 4608, 132) == FUSED_TMA_CONFIG
    assert fused_tma_config(4096, 6144, 132) == FUSED_TMA_CONFIG
    assert fused_tma_config(32760, 1536, 132) == FUSED_TMA_CONFIG
    assert fused_tma_config(128, 1536, 132) == FUSED_TMA_NARROW_CONFIG  # 6 tiles of 132


def test_a_prepared_layer_names_the_forms_it_takes():
    from shuttle.kernels import PreparedLoraLinear

    w, down, up = torch.zeros(16, 32), torch.zeros(8, 32), torch.zeros(16, 8)
    with pytest.raises(ValueError, match="form must be one of"):
        PreparedLoraLinear(w, None, down, up, "cute")
