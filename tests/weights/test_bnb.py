"""bitsandbytes NF4/FP4 and int8 weights against bitsandbytes' own quantization."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shuttle.errors import MissingDependencyError
from shuttle.weights import Bnb4bitWeight, BnbInt8Weight, represent

bnb = pytest.importorskip("bitsandbytes")
F = bnb.functional

CONFIGS = [(qt, nested) for qt in ("nf4", "fp4") for nested in (False, True)]


def weight(rows: int = 12, cols: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.logspace(-2, 1, rows).unsqueeze(1)


def params4bit(w: torch.Tensor, quant_type: str, nested: bool):
    q, qs = F.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=nested)
    return bnb.nn.Params4bit(q, requires_grad=False, quant_state=qs, blocksize=64,
                             compress_statistics=nested, quant_type=quant_type,
                             bnb_quantized=True)


def int8params(w: torch.Tensor):
    return bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False).to("cpu")


def step_bound(rep: Bnb4bitWeight, x: torch.Tensor) -> torch.Tensor:
    """Per element: the widest gap of the code times its block's scale (one 4-bit step)."""
    code = rep.code.float().sort().values
    scales = rep._scales().repeat_interleave(rep.blocksize)[:x.numel()].view(x.shape)
    return (code[1:] - code[:-1]).max() * scales


@pytest.mark.parametrize(("quant_type", "nested"), CONFIGS)
def test_dequantize_is_bitsandbytes_own(quant_type, nested):
    p = params4bit(weight(), quant_type, nested)
    rep = represent(p)
    assert isinstance(rep, Bnb4bitWeight) and rep.nested == nested
    assert rep.logical_shape == (12, 64) and rep.compute_dtype == torch.float32
    assert torch.equal(rep.dequantize(), F.dequantize_4bit(p.data, p.quant_state))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_nearest_encode_is_bitsandbytes_quantize(quant_type):
    w = weight(seed=1)
    p = params4bit(w, quant_type, nested=False)
    enc = represent(p).encode(w, "nearest")
    assert torch.equal(enc.packed, p.data) and torch.equal(enc.absmax, p.quant_state.absmax)


@pytest.mark.parametrize(("quant_type", "nested"), CONFIGS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_encode_within_a_step_and_scales_recomputed(quant_type, nested, rounding):
    rep = represent(params4bit(weight(), quant_type, nested))
    x = weight(seed=2) * 3  # new data: the absmax must follow it
    enc = rep.encode(x, rounding, torch.Generator().manual_seed(0))
    assert all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(enc.tensors().values(), rep.tensors().values(), strict=True))
    err = (enc.dequantize() - x).abs()
    bound = step_bound(enc, x) * (0.5 if rounding == "nearest" else 1.0)
    assert (err <= bound * (1 + 1e-5)).all()
    # every block's scale covers its largest value: nothing was clamped
    blocks = x.reshape(-1, 64).abs().amax(dim=1)
    assert (enc._scales() >= blocks * (1 - 1e-6)).all()


@pytest.mark.parametrize("nested", [False, True])
def test_stochastic_nf4_is_unbiased_and_repeatable(nested):
    x = weight(rows=2, seed=3)
    rep = represent(params4bit(x, "nf4", nested))
    n = 400
    mean = sum(rep.encode(x, "stochastic", torch.Generator().manual_seed(s)).dequantize()
               for s in range(n)) / n
    nearest = rep.encode(x, "nearest").dequantize()
    # each draw is off by at most one step; the mean of n draws within ~4 sigma of x
    tol = 4 * step_bound(rep, x) / (2 * n ** 0.5)
    assert ((mean - x).abs() <= tol).all()
    assert (mean - x).abs().mean() < 0.5 * (nearest - x).abs().mean()
    a = rep.encode(x, "stochastic", torch.Generator().manual_seed(7))
    b = rep.encode(x, "stochastic", torch.Generator().manual_seed(7))
    c = rep.encode(x, "stochastic", torch.Generator().manual_seed(8))
    assert torch.equal(a.packed, b.packed) and not torch.equal(a.packed, c.packed)


def test_int8_dequantize_and_encode_are_bitsandbytes_own():
    w = weight()
    p = int8params(w)
    rep = represent(p)
    assert isinstance(rep, BnbInt8Weight) and rep.logical_shape == (12, 64)
    assert torch.equal(rep.dequantize(), F.int8_vectorwise_dequant(p.data, p.SCB))
    enc = rep.encode(w.half().float())  # Int8Params quantizes a float16 copy
    assert torch.equal(enc.data, p.data) and torch.equal(enc.scb, p.SCB)


def test_int8_stochastic_unbiased():
    x = weight(rows=2)
    rep = represent(int8params(x))
    n = 400
    mean = sum(rep.encode(x, "stochastic", torch.Generator().manual_seed(s)).dequantize()
               for s in range(n)) / n
    step = rep.scb.view(-1, 1) / 127
    assert ((mean - x).abs() <= 4 * step / (2 * n ** 0.5)).all()


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_copies_keep_the_form_and_write_back_in_place(kind):
    w = weight()
    p = params4bit(w, "nf4", True) if kind == "nf4" else int8params(w)
    rep = represent(p)
    moved = rep.to("cpu", non_blocking=True)
    assert type(moved) is type(rep) and torch.equal(moved.dequantize(), rep.dequantize())
    assert rep.nbytes == sum(t.numel() * t.element_size() for t in rep.tensors().values())
    if not torch.accelerator.is_available():
        assert rep.pin() is rep  # nothing to pin for
    ptrs = {n: t.data_ptr() for n, t in rep.tensors().items()}
    new = rep.encode(weight(seed=5))
    new.write_into(p)
    again = represent(p)
    assert {n: t.data_ptr() for n, t in again.tensors().items()} == ptrs  # same storage
    assert torch.equal(again.dequantize(), new.dequantize())
    fresh = new.to_parameter()
    assert torch.equal(represent(fresh).dequantize(), new.dequantize())


def test_to_parameter_runs_in_linear4bit():
    rep = represent(params4bit(weight(), "nf4", True))
    layer = bnb.nn.Linear4bit(64, 12, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = rep.to_parameter()
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ rep.dequantize().T, rtol=1e-5, atol=1e-5)


def test_missing_library_names_the_extra(monkeypatch):
    from shuttle.weights import bnb as module

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(MissingDependencyError, match=r"shuttle\[bnb\]"):
        module._bnb()


def test_plain_tensors_import_no_quantization_library():
    code = ("import sys, torch; from shuttle.weights import represent; "
            "represent(torch.zeros(2)); represent(torch.zeros(2, dtype=torch.float8_e4m3fn)); "
            "bad = [m for m in ('bitsandbytes', 'torchao', 'optimum.quanto') if m in sys.modules];"
            " assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": "src"},
                   cwd=str(__import__("pathlib").Path(__file__).parents[2]))
