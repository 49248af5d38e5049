"""GGUFParameter: GGUF blocks kept in a module, dequantized on use; its representation, dynamic
adapters over it, the refused merge, and offloading its stored bytes.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import shuttle
from shuttle.errors import ShuttleError, UnmergeableWeightError
from shuttle.offload import CPU_COPY_ENV, ModelOffloader, StreamConfig
from shuttle.weights import GGUFParameter, GGUFWeight, dequantize_blocks, represent
from tests import lowrank_state
from tests.weights.test_gguf import random_blocks

TYPES = ["Q8_0", "Q4_0", "Q4_K", "Q6_K"]


def gguf_bytes(name: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """``(rows, row_bytes)`` blocks: the gguf package's own quantization of a random weight
    where it has one (Q8_0, Q4_0), else random blocks with moderate scales."""
    try:
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.1
        return torch.from_numpy(quantize(x, GGMLQuantizationType[name]))
    except (ImportError, NotImplementedError):
        values, size, *_ = shuttle.weights.GGUF_TYPES[name]
        return random_blocks(name, rows * cols // values, seed).reshape(rows, -1)


def gguf_param(name: str, rows: int = 16, cols: int = 256, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> GGUFParameter:
    return GGUFParameter(gguf_bytes(name, rows, cols, seed), name, (rows, cols), dtype)


def reference(p: GGUFParameter) -> torch.Tensor:
    raw = p.data.detach()
    with torch._C.DisableTorchFunctionSubclass():
        raw = raw.view(-1)
    return dequantize_blocks(raw, p.qtype).reshape(p.weight_shape).to(p.compute_dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(represent(a).raw if isinstance(a, GGUFParameter) else a,
                       represent(b).raw if isinstance(b, GGUFParameter) else b)


def test_keeps_bytes_and_metadata_through_moves_and_copies():
    raw = gguf_bytes("Q4_K", 16, 256)
    p = GGUFParameter(raw, "q4_k", (16, 256), torch.float32)
    assert p.qtype == "Q4_K" and p.weight_shape == (16, 256) and p.compute_dtype == torch.float32
    assert p.dtype == torch.uint8 and p.shape == raw.shape and p.data_ptr() == raw.data_ptr()
    assert isinstance(p, torch.nn.Parameter) and not p.requires_grad
    assert not p.is_floating_point()
    moved = [p.to("cpu"), p.cpu(), p.detach(), p.data, copy.deepcopy(p), p.clone()]
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    moved.append(torch.load(buf, weights_only=False))
    for q in moved:
        assert type(q) is GGUFParameter
        assert (q.qtype, q.weight_shape, q.compute_dtype) == ("Q4_K", (16, 256), torch.float32)
        assert same_bytes(q, raw)
    assert p.to("cpu") is p and p.detach().data_ptr() == raw.data_ptr()
    assert copy.deepcopy(p).data_ptr() != raw.data_ptr()
    bf = p.to(torch.bfloat16)  # a float dtype is the compute dtype; the bytes stay
    assert type(bf) is GGUFParameter and bf.compute_dtype == torch.bfloat16
    assert bf.data_ptr() == raw.data_ptr() and bf.dtype == torch.uint8
    assert "Q4_K" in repr(p) and "(16, 256)" in repr(p)
    assert len({p, p}) == 1  # hashed as itself, not as a dequantized copy


def test_module_conversions_and_state_dict_keep_the_blocks():
    lin = torch.nn.Linear(256, 16)
    lin.weight = gguf_param("Q6_K")
    raw = lin.weight.data_ptr()
    lin.half()  # uint8 storage is not a floating tensor: left alone
    lin.float()
    lin.to("cpu")
    assert type(lin.weight) is GGUFParameter and lin.weight.data_ptr() == raw
    other = torch.nn.Linear(256, 16)
    other.weight = gguf_param("Q6_K", seed=1)
    other.load_state_dict(lin.state_dict())  # copy_ of bytes
    assert type(other.weight) is GGUFParameter and same_bytes(other.weight, lin.weight)
    assert list(dict(lin.named_parameters())) == ["weight", "bias"]


def test_refuses_changes_that_would_need_re_encoding():
    p = gguf_param("Q8_0")
    before = p.data.clone()
    with pytest.raises(ShuttleError, match="re-encoded"):
        p.add_(1)
    with pytest.raises(ShuttleError, match="uint8"):
        p.copy_(torch.zeros(p.weight_shape))
    with pytest.raises(ShuttleError, match="cannot copy"):
        p.copy_(gguf_param("Q4_0"))
    with pytest.raises(ShuttleError, match="uint8"):
        GGUFParameter(torch.zeros(4, 34), "Q8_0", (4, 32))
    with pytest.raises(ShuttleError, match="does not hold"):
        GGUFParameter(torch.zeros(4, 34, dtype=torch.uint8), "Q8_0", (4, 64))
    assert same_bytes(p, before)


@pytest.mark.parametrize("name", TYPES)
def test_linear_equals_the_dequantized_reference(name):
    p = gguf_param(name)
    w = reference(p)
    assert torch.equal(p.dequantize(), w)
    x = torch.randn(3, 256)
    lin = torch.nn.Linear(256, 16)
    lin.weight = GGUFWeight(represent(p).raw, name, (16, 256), torch.float32).to_parameter()
    assert torch.equal(F.linear(x, p), F.linear(x, w))
    assert torch.equal(lin(x), F.linear(x, w, lin.bias))
    assert torch.equal(x @ p.T, x @ w.T)
    p16 = p.to(torch.bfloat16)
    assert torch.equal(F.linear(x.bfloat16(), p16), F.linear(x.bfloat16(), w.bfloat16()))


def test_representation_shares_the_bytes():
    p = gguf_param("Q4_0", dtype=torch.bfloat16)
    rep = represent(p)
    assert type(rep) is GGUFWeight and type(rep.raw) is torch.Tensor
    assert rep.raw.data_ptr() == p.data_ptr() and rep.nbytes == p.numel()
    assert rep.logical_shape == (16, 256) and rep.compute_dtype == torch.bfloat16
    assert torch.equal(rep.dequantize().bfloat16(), p.dequantize())
    back = GGUFParameter.from_weight(rep)
    assert back.data_ptr() == p.data_ptr() and back.qtype == "Q4_0"
    target = torch.zeros_like(rep.raw)
    rep.rebind(back, {"raw": target})  # what the offloader does
    assert type(back) is GGUFParameter and back.data_ptr() == target.data_ptr()
    assert back.qtype == "Q4_0" and back.weight_shape == (16, 256)
    assert not shuttle.apply.plan.is_plain_tensor(p)


# -- adapters --------------------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self, name: str, gguf: bool = True):
        super().__init__()
        self.first = torch.nn.Linear(256, 256)
        self.layer = torch.nn.Linear(256, 16)
        p = gguf_param(name, seed=2)
        self.layer.weight = p if gguf else torch.nn.Parameter(reference(p))

    def forward(self, x):
        return self.layer(self.first(x))


def adapter(seed: int = 3):
    return shuttle.load_lora(lowrank_state({"first": (256, 256), "layer": (16, 256)},
                                           seed=seed))


@pytest.mark.parametrize("quality", ["exact", "lossless"])
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_attach_lora_equals_the_dequantized_linear(name, quality):
    torch.manual_seed(0)
    model = Net(name)
    torch.manual_seed(0)
    plain = Net(name, gguf=False)
    x = torch.randn(5, 256)
    lora = [(adapter(), 0.7)]
    with torch.no_grad():
        base = model(x)
        assert torch.equal(base, plain(x))
        h1 = shuttle.attach_lora(model, lora, quality=quality)
        h2 = shuttle.attach_lora(plain, lora, quality=quality)
        got, want = model(x), plain(x)
        h1.detach()
        h2.detach()
    assert not torch.equal(got, base)
    if quality == "exact":  # the same chain of ops on the same dequantized weight
        assert torch.equal(got, want)
    else:  # plain Linear adds the update in place (addmm_), the GGUF one out of place
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert type(model.layer.weight) is GGUFParameter
    assert torch.equal(model(x), base)


@pytest.mark.parametrize("how", ["merge_lora", "apply_lora"])
def test_merge_is_refused_before_any_change(how):
    model = Net("Q4_K")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnmergeableWeightError, match='mode="dynamic"') as e:
        if how == "merge_lora":
            shuttle.merge_lora(model, [(adapter(), 1.0)])
        else:
            with shuttle.apply_lora(model, [(adapter(), 1.0)], mode="merge"):
                pass
    assert "GGUFWeight" in str(e.value)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert type(model.layer.weight) is GGUFParameter


# -- offload ---------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, name: str, seed: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(256)
        self.lin = torch.nn.Linear(256, 256)
        self.lin.weight = gguf_param(name, 256, 256, seed)

    def forward(self, x):
        return x + self.lin(self.norm(x))


class GModel(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(16, 256)
        # Q4_0 and Q4_K rows of 256 values both take 144 bytes: one slot layout, and each
        # parameter keeps its own type when rebound to a slot's bytes.
        self.blocks = torch.nn.ModuleList(
            Block(n, seed + i) for i, n in enumerate(["Q4_K", "Q4_0", "Q4_K"]))
        self.head = torch.nn.Linear(256, 8)
        self.head.weight = gguf_param("Q6_K", 8, 256, seed + 7)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def inside(t: torch.Tensor, flats: list[torch.Tensor]) -> bool:
    return any(f.data_ptr() <= t.data_ptr() < f.data_ptr() + f.numel() for f in flats)


def block_adapter():
    sd = lowrank_state({f"blocks.{i}.lin": (256, 256) for i in range(3)}, scale=0.05)
    return [(shuttle.load_lora(sd), 0.7)]


@pytest.mark.parametrize("stream", [None, StreamConfig(prefetch=1)], ids=["whole", "stream1"])
def test_offload_streams_the_stored_blocks(monkeypatch, stream):
    monkeypatch.setenv(CPU_COPY_ENV, "1")
    ref, model = GModel(), GModel()
    gguf = {n: p for n, p in ref.named_parameters() if type(p) is GGUFParameter}
    off = ModelOffloader.from_module(model, blocks=["blocks"])
    raw_bytes = sum(p.numel() for p in gguf.values())
    other = sum(p.numel() * p.element_size() for n, p in ref.named_parameters() if n not in gguf)
    assert off.storage.weight_bytes == raw_bytes + other  # stored blocks, not dequantized
    for n, p in off.model.named_parameters():
        if n in gguf:
            assert type(p) is GGUFParameter and p.qtype == gguf[n].qtype and same_bytes(p, gguf[n])
    x = torch.randn(4, 16)
    loras = block_adapter()
    with torch.no_grad():
        want = ref(x)
        h = shuttle.attach_lora(ref, loras)
        want_lora = ref(x)
        h.detach()
    assert not torch.equal(want, want_lora)
    arenas = [u.arena for u in off.storage.units]
    seen = []

    def in_slots(m, args):  # the layer computes from the slot's copy of its blocks
        slots = [b for pool in off._active.pools for b in pool.buffers]
        seen.append(inside(m.weight, slots) and not inside(m.weight, arenas))

    handles = [b.lin.register_forward_pre_hook(in_slots) for b in off.model.blocks]
    with off.use("cpu", stream) as m, torch.no_grad():
        assert torch.equal(m(x), want)
    for handle in handles:
        handle.remove()
    assert len(seen) == 3 and all(seen)
    assert all(inside(b.lin.weight, arenas) for b in off.model.blocks)
    with off.use("cpu", stream, loras=loras, mode="dynamic") as m, torch.no_grad():
        for _ in range(2):
            assert torch.equal(m(x), want_lora)
    with pytest.raises(shuttle.errors.UnsupportedLayerError, match="dynamic"):
        off.activate("cpu", stream, loras=loras, mode="merge")
    with torch.no_grad():  # back on the host, unchanged
        assert torch.equal(off.model(x), want)
    for n, p in off.model.named_parameters():
        if n in gguf:
            assert type(p) is GGUFParameter and same_bytes(p, gguf[n])
