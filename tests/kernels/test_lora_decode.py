"""The one-launch decode update against its PyTorch reference and float64 math.

On CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest); on CUDA it is compiled.
"""

from __future__ import annotations

import pytest
import torch

from shuttle.kernels import triton_available
from shuttle.kernels.lora_decode import (
    PreparedLoraDecode,
    lora_decode_add,
    lora_decode_add_reference,
    lora_decode_linear,
    lora_decode_linear_reference,
)
from tests.kernels.test_lora_linear import _assert_one_ulp

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(t, k, n, r, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(t, n, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(t, k, generator=g).to(dtype).to(DEVICE)
    down = (torch.randn(r, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    up = (torch.randn(n, r, generator=g) * 0.3).to(dtype).to(DEVICE)
    scale = (0.25 + torch.rand(r, generator=g)).to(DEVICE)
    return out, x, down, up, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("t", "k", "n", "r"), [(1, 40, 100, 3), (16, 70, 130, 20), (64, 32, 64, 16)]
)
def test_matches_reference_and_float64(t, k, n, r, dtype):
    out, x, down, up, scale = _case(t, k, n, r, dtype)
    got = lora_decode_add(out.clone(), x, down, up, scale)
    want = lora_decode_add_reference(out.clone(), x, down, up, scale)
    _assert_one_ulp(got, want)  # float32 summation order may differ from the reference's
    exact = out.double() + ((x.double() @ down.double().T) * scale.double()) @ up.double().T
    assert int((got != exact.to(dtype)).sum()) <= max(4, got.numel() // 100)


def test_in_place_on_a_row_strided_view():
    out, x, down, up, scale = _case(5, 48, 80, 8, torch.bfloat16)
    buf = torch.zeros(5, 100, dtype=torch.bfloat16, device=DEVICE)
    buf[:, 10:90] = out
    view = buf[:, 10:90]
    assert lora_decode_add(view, x, down, up, scale) is view
    want = lora_decode_add_reference(out.clone(), x, down, up, scale)
    assert int((buf[:, 10:90] != want).sum()) <= 4
    assert not buf[:, :10].any() and not buf[:, 90:].any()


def test_bad_shapes_and_too_many_rows():
    out, x, down, up, scale = _case(4, 32, 48, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="expected"):
        lora_decode_add(out, x, down[:, :16], up, scale)
    big = _case(65, 32, 48, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="at most 64 rows"):
        lora_decode_add(*big)


def test_float32_falls_back_to_the_reference():
    out, x, down, up, scale = _case(4, 32, 48, 8, torch.float32)
    got = lora_decode_add(out.clone(), x, down, up, scale)
    assert torch.equal(got, lora_decode_add_reference(out.clone(), x, down, up, scale))


def _layer(t, k, n, r, dtype, seed=0):
    _, x, down, up, scale = _case(t, k, n, r, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    bias = (torch.randn(n, generator=g) * 0.5).to(dtype).to(DEVICE)
    return x, w, bias, down, up, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    # odd K (masked tail), K a multiple of the step, N not a multiple of the column tile,
    # R of 1 and R above a power of two
    ("t", "k", "n", "r"), [(1, 40, 100, 3), (16, 70, 130, 20), (64, 32, 64, 16), (3, 48, 17, 1)]
)
@pytest.mark.parametrize("shrink_k", [16, 48], ids=["many-partials", "few-partials"])
def test_linear_matches_reference_and_float64(t, k, n, r, dtype, bias, shrink_k):
    x, w, b, down, up, scale = _layer(t, k, n, r, dtype)
    b = b if bias else None
    config = (16, 16, 1, 1, shrink_k) if DEVICE == "cpu" else (32, 128, 4, 3, shrink_k * 8)
    got = lora_decode_linear(x, w, b, down, up, scale, config=config)
    want = lora_decode_linear_reference(x, w, b, down, up, scale)
    _assert_one_ulp(got, want)
    exact = x.double() @ w.double().T + ((x.double() @ down.double().T) * scale.double()) \
        @ up.double().T + (b.double() if bias else 0)
    assert int((got != exact.to(dtype)).sum()) <= max(4, got.numel() // 100)


def test_linear_on_strided_rows():
    x, w, b, down, up, scale = _layer(5, 48, 80, 8, torch.bfloat16)
    wide = torch.zeros(5, 64, dtype=x.dtype, device=DEVICE)
    wide[:, :48] = x
    got = lora_decode_linear(wide[:, :48], w, b, down, up, scale)
    _assert_one_ulp(got, lora_decode_linear_reference(x, w, b, down, up, scale))


def test_linear_bad_shapes_and_too_many_rows():
    x, w, b, down, up, scale = _layer(4, 32, 48, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="expected"):
        lora_decode_linear(x, w[:, :16], b, down, up, scale)
    with pytest.raises(ValueError, match="expected"):
        lora_decode_linear(x, w, b[:5], down, up, scale)
    big = _layer(65, 32, 48, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="at most 64 rows"):
        lora_decode_linear(*big)
    with pytest.raises(ValueError, match="shrink_k"):
        lora_decode_linear(x, w, b, down, up, scale, config=(16, 16, 1, 1, 0))


def test_linear_mixed_dtypes_fall_back_to_the_reference():
    x, w, b, down, up, scale = _layer(4, 32, 48, 8, torch.bfloat16)
    got = lora_decode_linear(x, w, b, down.float(), up.float(), scale)
    assert torch.equal(got, lora_decode_linear_reference(x, w, b, down.float(), up.float(),
                                                         scale))


def test_linear_under_autograd_is_differentiable():
    x, w, b, down, up, scale = _layer(4, 32, 48, 8, torch.bfloat16)
    up = up.clone().requires_grad_()
    lora_decode_linear(x, w, b, down, up, scale).float().sum().backward()
    assert up.grad is not None and bool(up.grad.abs().sum() > 0)


def test_linear_partials_are_deterministic():
    x, w, b, down, up, scale = _layer(16, 300, 96, 12, torch.bfloat16)
    first = lora_decode_linear(x, w, b, down, up, scale)
    assert all(torch.equal(first, lora_decode_linear(x, w, b, down, up, scale))
               for _ in range(3))


def test_aligned_needs_16_byte_rows_and_multiples_of_16():
    from shuttle.kernels.lora_decode import _aligned

    a = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert _aligned(a, a, sizes=(64, 32))
    assert not _aligned(a, sizes=(40, 32)) and not _aligned(a, sizes=(64, 24))  # K, N
    assert not _aligned(a, a[:, 1:], sizes=(64,))  # rows start 2 bytes off
    assert not _aligned(torch.zeros(4, 60, dtype=torch.bfloat16)[:, :8], sizes=(64,))  # stride
    assert not _aligned(a.float(), sizes=(64,))  # 4-byte elements


def _shifted(t):
    """``t``'s values in storage that starts 2 bytes past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)[1:1 + t.numel()]
    return buf.view_as(t).copy_(t)


@pytest.mark.parametrize("shift", ["none", "x", "weight", "up"])
@pytest.mark.parametrize(("t", "k", "n", "r"), [(16, 256, 96, 16), (5, 48, 64, 32)])
def test_aligned_and_misaligned_layouts_agree(t, k, n, r, shift):
    # K and N multiples of 16 (the kernels' alignment hints apply unless a tensor is shifted);
    # K = 48 is not a multiple of the GPU's K step (masked, hinted tail).
    x, w, b, down, up, scale = _layer(t, k, n, r, torch.bfloat16)
    ops = {"x": x, "weight": w, "up": up}
    if shift != "none":
        ops[shift] = _shifted(ops[shift])
    got = lora_decode_linear(ops["x"], ops["weight"], b, down, ops["up"], scale)
    _assert_one_ulp(got, lora_decode_linear_reference(x, w, b, down, up, scale))
    out = torch.randn(t, n, dtype=x.dtype, device=DEVICE)
    got = lora_decode_add(out.clone(), ops["x"], down, ops["up"], scale)
    _assert_one_ulp(got, lora_decode_add_reference(out.clone(), x, down, up, scale))


def _no_function(monkeypatch, name):
    """Make ``lora_decode.<name>`` (the prepared path's fallback) fail if called."""
    from shuttle.kernels import lora_decode

    monkeypatch.setattr(lora_decode, name, lambda *a, **kw: pytest.fail(f"{name} called"))


@pytest.mark.parametrize(("t", "k", "n", "r"), [(1, 40, 100, 3), (16, 64, 96, 16),
                                                (40, 48, 64, 32)])
def test_prepared_add_equals_the_function(t, k, n, r, monkeypatch):
    out, x, down, up, scale = _case(t, k, n, r, torch.bfloat16)
    prep = PreparedLoraDecode(down, up)
    want = lora_decode_add(out.clone(), x, down, up, scale)
    _no_function(monkeypatch, "lora_decode_add")
    for _ in range(3):  # the first calls compile and bind; later ones launch bound
        got = out.clone()
        assert prep.add(got, x, scale) is got
        assert torch.equal(got, want)
    # (B, S, K) activations onto a (B, S, N) output; a misaligned x (its own binding)
    got3 = out.clone().view(1, t, n)
    assert torch.equal(prep.add(got3, x.view(1, t, k), scale).view(t, n), want)
    assert torch.equal(prep.add(out.clone(), _shifted(x), scale), want)


def test_prepared_add_takes_the_function_where_the_kernel_does_not_fit():
    out, x, down, up, scale = _case(4, 32, 48, 8, torch.bfloat16)
    prep = PreparedLoraDecode(down, up)
    want = lora_decode_add_reference(out.clone(), x, down, up, scale)
    # a float64 scale (converted by the function), a transposed output
    _assert_one_ulp(prep.add(out.clone(), x, scale.double()), want)
    t_out = out.T.contiguous().T
    _assert_one_ulp(prep.add(t_out, x, scale), want)
    with pytest.raises(ValueError, match="at most 64 rows"):
        prep.add(*_case(65, 32, 48, 8, torch.bfloat16)[:2], scale)
    fp32 = PreparedLoraDecode(down.float(), up.float())
    assert not fp32.usable
    assert torch.equal(fp32.add(out.float(), x.float(), scale),
                       lora_decode_add_reference(out.float(), x.float(), down.float(),
                                                 up.float(), scale))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("t", "k", "n", "r"), [(1, 40, 100, 3), (16, 64, 96, 16),
                                                (3, 48, 17, 1)])
def test_prepared_linear_equals_the_function(t, k, n, r, bias, monkeypatch):
    x, w, b, down, up, scale = _layer(t, k, n, r, torch.bfloat16)
    b = b if bias else None
    prep = PreparedLoraDecode(down, up)
    want = lora_decode_linear(x, w, b, down, up, scale)
    _no_function(monkeypatch, "lora_decode_linear")
    for _ in range(3):
        assert torch.equal(prep.linear(x, w, b, scale), want)
    assert torch.equal(prep.linear(_shifted(x), w, b, scale), want)


def test_prepared_linear_follows_the_layers_weight_and_bias(monkeypatch):
    x, w, b, down, up, scale = _layer(5, 48, 64, 8, torch.bfloat16)
    prep = PreparedLoraDecode(down, up)
    layer = torch.nn.Linear(48, 64, dtype=torch.bfloat16, device=DEVICE).requires_grad_(False)
    layer.weight.copy_(w)
    layer.bias.copy_(b)
    assert torch.equal(prep.linear(x, layer.weight, layer.bias, scale),
                       lora_decode_linear(x, w, b, down, up, scale))
    _no_function(monkeypatch, "lora_decode_linear")
    layer.bias = None  # no bias now: another output kernel
    assert torch.equal(prep.linear(x, layer.weight, None, scale),
                       lora_decode_linear(x, w, None, down, up, scale))
    w2 = _shifted(torch.randn_like(w))  # new storage, misaligned rows: bound again
    layer.weight.data = w2
    want = lora_decode_linear_reference(x, w2, None, down, up, scale)
    _assert_one_ulp(prep.linear(x, layer.weight, None, scale), want)


def test_prepared_linear_under_autograd_is_the_differentiable_reference():
    x, w, b, down, up, scale = _layer(4, 32, 48, 8, torch.bfloat16)
    prep = PreparedLoraDecode(down, up)
    w = w.clone().requires_grad_()
    prep.linear(x, w, b, scale).float().sum().backward()
    assert w.grad is not None and bool(w.grad.abs().sum() > 0)


@pytest.mark.gpu
def test_linear_output_kernel_reads_the_partials_once_the_shrink_ended():
    """On sm_90 the output kernel is launched as the shrink's programmatic dependent: it
    streams W while the shrink runs and reads the partials after the shrink's end. After a
    kernel writing them a millisecond late, it gives the shipped result bit for bit; compiled
    without its wait (PDL off, launched early all the same) it reads them before they exist.
    """
    from shuttle.kernels.launch import dependent_launch
    from shuttle.kernels.lora_decode import DECODE_LINEAR_CONFIG, _linear_launch, decode_kernels
    from tests.kernels.test_launch import late_copy

    if not dependent_launch(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs sm_90 and a Triton with it")
    t, k, n, r = 16, 4096, 6144, 16
    x, w, b, down, up, scale = _layer(t, k, n, r, torch.bfloat16)
    want = lora_decode_linear(x, w, b, down, up, scale)
    plan = _linear_launch(t, k, n, r, DECODE_LINEAR_CONFIG, False, True, True, True, True, True)
    assert plan.shrink["PDL"] and plan.output["PDL"] and plan.output["launch_pdl"]
    _, output, shrink = decode_kernels()
    partials = torch.empty(plan.parts * plan.shrink["BT"] * plan.shrink["BR"],
                           dtype=torch.float32, device="cuda")
    shrink((plan.parts,), x, down, partials, t, k, r, plan.per, k, k, **plan.shrink)

    def run(ws, wait):
        out = torch.empty(t, n, dtype=x.dtype, device="cuda")
        output(plan.grid, x, w, b, up, scale, ws, out, t, k, n, r, k, k, r, n,
               **{**plan.output, "PDL": wait})
        return out
    for wait in (False, True):  # compiled first: a compile would outlast the late copy
        run(partials, wait)
    for wait in (False, True):
        ws = torch.zeros_like(partials)
        late_copy(partials, ws)
        got = run(ws, wait)
        torch.cuda.synchronize()
        assert torch.equal(got, want) == wait
