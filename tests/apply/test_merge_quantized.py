"""Merging into and dynamic LoRA over bitsandbytes / quanto / torchao quantized Linear layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import UnmergeableWeightError
from shuttle.weights import represent


def lora(rows=8, cols=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(2, cols, generator=g) / 4, torch.randn(rows, 2, generator=g) / 4
    return {"layer.lora_A.weight": a, "layer.lora_B.weight": b}, b @ a


def wrap(layer):
    model = nn.Sequential()
    model.layer = layer
    return model


def bnb_model(kind):
    bnb = pytest.importorskip("bitsandbytes")
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    if kind == "int8":
        layer = bnb.nn.Linear8bitLt(64, 8, bias=False, has_fp16_weights=False)
        layer.load_state_dict({"weight": w})
        return wrap(layer.to("cpu"))
    layer = bnb.nn.Linear4bit(64, 8, bias=False, compute_dtype=torch.float32, quant_type=kind)
    layer.load_state_dict({"weight": w})
    return wrap(layer.to("cpu"))


def quanto_model(qtype):
    quanto = pytest.importorskip("optimum.quanto")
    torch.manual_seed(1)
    model = wrap(nn.Linear(64, 8, bias=False))
    quanto.quantize(model, weights=getattr(quanto, qtype))
    quanto.freeze(model)
    return model


def torchao_model(kind):
    q = pytest.importorskip("torchao.quantization")
    torch.manual_seed(1)
    model = wrap(nn.Linear(64, 8, bias=False))
    q.quantize_(model, q.Float8WeightOnlyConfig() if kind == "f8" else q.Int8WeightOnlyConfig())
    return model


MODELS = {"nf4": lambda: bnb_model("nf4"), "fp4": lambda: bnb_model("fp4"),
          "int8": lambda: bnb_model("int8"), "qint8": lambda: quanto_model("qint8"),
          "qfloat8": lambda: quanto_model("qfloat8"), "ao_f8": lambda: torchao_model("f8"),
          "ao_int8": lambda: torchao_model("int8")}


# The widest gap between neighbouring codes, relative to the absmax: NF4 1 - 0.7230, FP4
# 1 - 0.6667; int8 1/127; float8 e4m3 2**-3 of the value (at most of the absmax).
STEP = {"nf4": 0.2771, "fp4": 0.3334, "int8": 1 / 127, "qint8": 1 / 127, "ao_int8": 1 / 127,
        "qfloat8": 2**-3, "ao_f8": 2**-3}


def state(model):
    return {n: t.clone() for n, t in represent(model.layer.weight).tensors().items()}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("rounding", ["nearest", None])
def test_merge_within_a_step_of_float64_and_in_place(kind, rounding):
    model = MODELS[kind]()
    rep = represent(model.layer.weight)
    ptrs = {n: t.data_ptr() for n, t in rep.tensors().items()}
    adapter, d = lora()
    ref = rep.dequantize().double() + 0.8 * d.double()
    report = shuttle.merge_lora(model, [(adapter, 0.8)], rounding=rounding, seed=3)
    assert report.applied == ["layer.weight"]
    after = represent(model.layer.weight)
    assert {n: t.data_ptr() for n, t in after.tensors().items()} == ptrs  # written in place
    err = (after.dequantize().double() - ref).abs()
    # within one step (half a step for nearest): the widest code gap relative to the row's
    # (block's) absmax
    # (x1.1: bitsandbytes' nested absmax is rounded up by up to one 8-bit code step)
    bound = STEP[kind] * (0.5 if rounding == "nearest" else 1.0) * 1.1
    assert (err <= bound * ref.abs().amax(dim=1, keepdim=True)).all()
    x = torch.randn(3, 64)
    y = model(x.to(after.compute_dtype) if kind.startswith("ao") else x).float()
    torch.testing.assert_close(y, x @ after.dequantize().T, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("kind", ["nf4", "qint8", "ao_int8"])
def test_default_stochastic_is_repeatable(kind):
    adapter, _ = lora()
    a, b = MODELS[kind](), MODELS[kind]()
    shuttle.merge_lora(a, [(adapter, 0.8)], seed=1)
    shuttle.merge_lora(b, [(adapter, 0.8)], seed=1)
    assert all(torch.equal(x, y) for x, y in zip(state(a).values(), state(b).values(),
                                                 strict=True))


@pytest.mark.parametrize("kind", ["nf4", "int8", "qfloat8", "ao_f8"])
def test_scoped_merge_restores_every_storage_tensor(kind):
    model = MODELS[kind]()
    before = state(model)
    adapter, _ = lora()
    with shuttle.apply_lora(model, [(adapter, 1.0)], mode="merge"):
        assert any(not torch.equal(t, before[n]) for n, t in state(model).items())
    assert all(torch.equal(t, before[n]) for n, t in state(model).items())


def test_unmergeable_weight_raises_before_any_change():
    quanto = pytest.importorskip("optimum.quanto")
    torch.manual_seed(0)
    model = nn.Sequential()
    model.first = nn.Linear(64, 8, bias=False)
    model.layer = nn.Linear(64, 8, bias=False)
    quanto.quantize(model, weights=quanto.qint4, include="layer")  # packed int4: unmergeable
    quanto.freeze(model)
    assert type(model.layer.weight).__name__ == "WeightQBitsTensor"
    adapter, _ = lora()
    adapter = {**adapter, **{k.replace("layer", "first"): v for k, v in adapter.items()}}
    w0 = model.first.weight.detach().clone()
    with pytest.raises(UnmergeableWeightError, match="dynamic"):
        shuttle.merge_lora(model, [(adapter, 1.0)])
    assert torch.equal(model.first.weight, w0)
    # dynamic mode takes it: the layer's own int4 forward plus the residual
    x = torch.randn(3, 64)
    base = model.layer(x)
    with shuttle.apply_lora(model, [(adapter, 1.0)], mode="dynamic"):
        torch.testing.assert_close(model.layer(x), base + x @ lora()[1].T)


@pytest.mark.parametrize("kind", list(MODELS))
def test_dynamic_lora_uses_the_quantized_forward_plus_residual(kind):
    model = MODELS[kind]()
    adapter, d = lora()
    x = torch.randn(3, 64)
    if kind.startswith("ao"):
        x = x.to(represent(model.layer.weight).compute_dtype)
    before = state(model)
    # attached before the first forward: Linear8bitLt moves its row scales into module.state
    handle = shuttle.attach_lora(model, [(adapter, 0.5)])
    try:
        out = model(x)
        handle.set_strength(0, 0.0)
        base = model(x)
    finally:
        handle.detach()
    torch.testing.assert_close(out.float(), (base.float() + 0.5 * x.float() @ d.T),
                               rtol=0.02, atol=0.02)
    assert torch.equal(model(x), base)
    after = {"data": model.layer.weight.data, "scb": model.layer.state.SCB} if kind == "int8" \
        else state(model)  # Linear8bitLt keeps its row scales in module.state after a forward
    assert all(torch.equal(t, before[n]) for n, t in after.items())
