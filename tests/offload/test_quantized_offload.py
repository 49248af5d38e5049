"""Quantized weights offloaded in their stored form: every storage tensor (bitsandbytes packed
data and ``quant_state``, int8 ``SCB``, quanto/torchao inner tensors) moves with the weight."""

from __future__ import annotations

import pytest
import torch

import shuttle
from shuttle.errors import HostBackingError, UnsupportedLayerError
from shuttle.offload import ModelOffloader, StreamConfig
from shuttle.offload.host_storage import HostStorage
from shuttle.weights import Bnb4bitWeight, WeightRepresentation, represent
from tests import lowrank_state

KINDS = ["nf4", "nf4_nested", "int8", "quanto", "torchao_f8", "torchao_i8"]
MODES = {
    "whole": None,
    "stream0": StreamConfig(prefetch=0),
    "stream1": StreamConfig(prefetch=1),
    "resident": StreamConfig(prefetch=1, resident=1),
}



def quantized_linear(kind: str, lin: torch.nn.Linear) -> torch.nn.Module:
    """``lin`` quantized by the library ``kind`` names, on the CPU."""
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    if kind.startswith("nf4"):
        bnb = pytest.importorskip("bitsandbytes")
        nested = kind == "nf4_nested"
        m = bnb.nn.Linear4bit(w.shape[1], w.shape[0], compute_dtype=torch.float32,
                              quant_type="nf4", compress_statistics=nested)
        m.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4",
                                     compress_statistics=nested, blocksize=64)
        m.bias = torch.nn.Parameter(b)
        m = m.to("cpu")  # quantizes
        # Eval forwards on an AVX512-BF16 CPU would repack the weight in place: keep it stored.
        m.support_avx512bf16_for_cpu = False
        return m
    if kind == "int8":
        bnb = pytest.importorskip("bitsandbytes")
        m = bnb.nn.Linear8bitLt(w.shape[1], w.shape[0], has_fp16_weights=False, threshold=0.0)
        m.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
        m.bias = torch.nn.Parameter(b)
        return m.to("cpu")  # quantizes
    if kind == "quanto":
        quanto = pytest.importorskip("optimum.quanto")
        m = torch.nn.Sequential(lin)
        quanto.quantize(m, weights=quanto.qint8)
        quanto.freeze(m)
        return m[0]
    q = pytest.importorskip("torchao.quantization")
    m = torch.nn.Sequential(lin)
    q.quantize_(m, q.Float8WeightOnlyConfig() if kind == "torchao_f8" else
                q.Int8WeightOnlyConfig())
    return m[0]


class Block(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.lin = quantized_linear(kind, torch.nn.Linear(64, 64))

    def forward(self, x):
        return x + self.lin(self.norm(x))


class QModel(torch.nn.Module):
    """Quantized linears in three blocks and in the rest; plain layers around them."""

    def __init__(self, kind: str, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(16, 64)
        self.blocks = torch.nn.ModuleList(Block(kind) for _ in range(3))
        self.head = quantized_linear(kind, torch.nn.Linear(64, 64))
        self.register_buffer("shift", torch.randn(64))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) + self.shift


def snapshot(model):
    """Every parameter, buffer and quantized storage tensor: (pointer, value) by name."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[name] = (t.data_ptr(), t.detach().clone())
        qs = getattr(t, "quant_state", None)
        for attr in ("absmax", "code") if qs is not None else ():
            out[f"{name}.{attr}"] = (getattr(qs, attr).data_ptr(), getattr(qs, attr).clone())
        scb = getattr(t, "SCB", None)
        if scb is not None:
            out[f"{name}.SCB"] = (scb.data_ptr(), scb.clone())
    return out


def assert_unchanged(model, before):
    assert snapshot(model).keys() == before.keys()
    for k, (ptr, value) in snapshot(model).items():
        assert before[k][0] == ptr and torch.equal(before[k][1], value), k


def pair(kind: str):
    """(un-offloaded reference, offloader over an identical model)."""
    ref, model = QModel(kind), QModel(kind)
    return ref, ModelOffloader.from_module(model, blocks="blocks")


def storage_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The quantized weight's storage tensors as the layer uses them right now."""
    if getattr(module.weight, "SCB", "absent") is None:  # Linear8bitLt after a forward
        return [module.weight.data, module.state.SCB]
    return list(represent(module.weight).tensors().values())


def inside_any(t: torch.Tensor, flats: list[torch.Tensor]) -> bool:
    return any(f.data_ptr() <= t.data_ptr() < f.data_ptr() + f.numel() for f in flats)


def quantized_layers(model):
    return [b.lin for b in model.blocks] + [model.head]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_outputs_bit_equal_and_storage_moves(cpu_copy, kind, mode):
    ref, off = pair(kind)
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = ref(x)
    arenas = [u.arena for u in off.storage.units]
    seen = []

    def hook(m, args):
        slots = [b for p in off._active.pools for b in p.buffers]
        seen.append(all(inside_any(t, slots) and not inside_any(t, arenas)
                        for t in storage_tensors(m)))

    handles = [m.register_forward_pre_hook(hook) for m in quantized_layers(off.model)]
    for _ in range(2):
        with off.use("cpu", MODES[mode]) as model, torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), want)
        for m in quantized_layers(off.model):
            ts = [m.weight.data, m.weight.SCB] if kind == "int8" else storage_tensors(m)
            assert all(inside_any(t, arenas) for t in ts)
    for h in handles:
        h.remove()
    assert seen and all(seen)
    with torch.no_grad():  # back on the host, the model computes as before
        assert torch.equal(off.model(x), want)


@pytest.mark.parametrize("kind", KINDS)
def test_host_bytes_are_storage_bytes(kind):
    ref, off = pair(kind)
    expected, dense = 0, 0
    for m in ref.modules():
        for p in m._parameters.values():
            if p is None:
                continue
            rep = represent(p)
            expected += rep.nbytes if type(p.data) is not torch.Tensor or not \
                p.dtype.is_floating_point else p.numel() * p.element_size()
            dense += rep.logical_shape.numel() * 4
        expected += sum(b.numel() * b.element_size() for b in m._buffers.values())
    assert off.storage.weight_bytes == expected
    assert off.storage.weight_bytes < dense  # stored form, not dequantized
    for m in quantized_layers(off.model):
        assert type(m.weight) is type(quantized_layers(ref)[0].weight)


def test_quant_state_layout_entries():
    """Each storage tensor of a nested NF4 weight is a layout entry of its own."""
    model = QModel("nf4_nested")
    rep = represent(model.head.weight)
    specs = {(t.dtype, t.shape) for t in rep.tensors().values()}
    storage = HostStorage(model, {"blocks": list(model.blocks)})
    rest = storage.rest
    assert specs <= set(zip(rest.layout.dtypes, rest.layout.shapes, strict=True))
    parts = {b.part for b in rest.bindings if b.rep is not None}
    assert parts == {"packed", "absmax", "code", "offset", "nested_absmax", "nested_code"}
    qs = model.head.weight.quant_state
    for t in (model.head.weight.data, qs.absmax, qs.code, qs.offset, qs.state2.absmax,
              qs.state2.code):
        assert inside_any(t, [rest.arena])


def test_representation_without_rebind_is_refused_unchanged(monkeypatch):
    monkeypatch.setattr(Bnb4bitWeight, "param_attrs", {})  # nothing says where its tensors live
    model = QModel("nf4")
    before = snapshot(model)
    with pytest.raises(HostBackingError, match=r"head\.weight is a Params4bit.*rebind"):
        ModelOffloader.from_module(model, blocks="blocks")
    assert_unchanged(model, before)


def test_base_rebind_raises():
    with pytest.raises(NotImplementedError, match="rebind"):
        WeightRepresentation().rebind(torch.zeros(1), {})


def test_int8_after_its_first_forward_is_refused():
    """Linear8bitLt moves SCB into module.state on a forward: nothing to capture it from."""
    pytest.importorskip("bitsandbytes")
    model = QModel("int8")
    model(torch.randn(2, 16))
    before = snapshot(model)
    with pytest.raises(HostBackingError, match="SCB"):
        ModelOffloader.from_module(model, blocks="blocks")
    assert_unchanged(model, before)


def _nf4_adapter():
    sd = lowrank_state({f"blocks.{i}.lin": (64, 64) for i in range(3)})
    return [(shuttle.load_lora(sd), 0.7)]


@pytest.mark.parametrize("mode", ["whole", "stream1"])
def test_dynamic_lora_over_nf4_blocks_equals_attach_lora(cpu_copy, mode):
    loras = _nf4_adapter()
    ref, off = pair("nf4")
    x = torch.randn(4, 16)
    with torch.no_grad():
        plain = ref(x)
        handle = shuttle.attach_lora(ref, loras)
        want = ref(x)
        handle.detach()
    assert not torch.equal(want, plain)
    with off.use("cpu", MODES[mode], loras=loras, mode="dynamic") as model, \
            torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    with off.use("cpu", MODES[mode]) as model, torch.no_grad():
        assert torch.equal(model(x), plain)


@pytest.mark.parametrize("mode", ["merge", "auto"])
def test_merging_into_quantized_weights_while_active_is_refused(cpu_copy, mode):
    ref, off = pair("nf4")
    x = torch.randn(4, 16)
    with torch.no_grad():
        plain = ref(x)
    with pytest.raises(UnsupportedLayerError, match="dynamic"):
        off.activate("cpu", MODES["stream1"], loras=_nf4_adapter(), mode=mode)
    assert not off.active
    with off.use("cpu", MODES["stream1"]) as model, torch.no_grad():
        assert torch.equal(model(x), plain)
