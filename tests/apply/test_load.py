"""load_checkpoint against "load the checkpoint, then merge_lora", bit for bit; meta models,
set_weight, tied weights, shards, bad input (model unchanged), the loud report, peak memory."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import shuttle
from shuttle.errors import (
    AdapterFileError,
    CorruptFileError,
    DuplicateTargetError,
    InvalidOptionError,
    InvalidStrengthError,
    MissingParameterError,
    NonFiniteAdapterError,
    ShapeMismatchError,
    UnsupportedLayerError,
)
from shuttle.formats.safetensors_file import SafetensorsFile

DTYPES = [torch.float32, torch.bfloat16]


class Net(nn.Module):
    def __init__(self, gate: bool = False):
        super().__init__()
        self.a = nn.Linear(16, 12)
        self.b = nn.Linear(12, 8)
        self.norm = nn.LayerNorm(8)
        self.bn = nn.BatchNorm1d(8)  # persistent buffers: running_mean, running_var, ...
        self.register_buffer("cache", torch.zeros(3), persistent=False)
        if gate:  # a parameter only some checkpoints have (the VSA gate case)
            self.gate = nn.Linear(8, 4, bias=False)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight


def bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()


def model_hash(model: nn.Module) -> dict[str, str]:
    """sha256 of every parameter's and buffer's bytes, with dtype, shape and device."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        raw = b"" if t.is_meta else bits(t)
        head = f"{t.dtype}{tuple(t.shape)}{t.device}".encode()
        out[name] = hashlib.sha256(head + raw).hexdigest()
    return out


def assert_same(model: nn.Module, ref: nn.Module) -> None:
    got, want = model.state_dict(), ref.state_dict()  # non-persistent buffers are not loaded
    assert got.keys() == want.keys()
    for n, w in want.items():
        assert got[n].dtype == w.dtype and got[n].shape == w.shape, n
        assert bits(got[n]) == bits(w), f"{n} differs"


def make_checkpoint(path, dtype, model_cls=Net, g=None, **kw) -> dict[str, torch.Tensor]:
    """A checkpoint with values unlike any fresh model's (so every write shows)."""
    g = g or torch.Generator().manual_seed(11)
    src = model_cls(**kw).to(dtype)
    sd = {k: (torch.randn(v.shape, generator=g) * 0.5).to(v.dtype) if v.is_floating_point()
          else v + 7 for k, v in src.state_dict().items()}
    if model_cls is Tied:
        del sd["head.weight"]  # safetensors stores a tied tensor once
    save_file(sd, str(path))
    return sd


def adapters(tmp_path, g=None) -> list[tuple[str, float]]:
    """Two adapter files: dense diffs (weight and bias), low-rank, and both on one weight."""
    g = g or torch.Generator().manual_seed(5)
    one = {"a.diff": torch.randn(12, 16, generator=g) * 0.01,
           "a.diff_b": torch.randn(12, generator=g) * 0.01,
           "b.lora_A.weight": torch.randn(2, 12, generator=g),
           "b.lora_B.weight": torch.randn(8, 2, generator=g) * 0.01}
    two = {"lora_unet_a.lora_down.weight": torch.randn(4, 16, generator=g).bfloat16(),
           "lora_unet_a.lora_up.weight": (torch.randn(12, 4, generator=g) * 0.01).bfloat16(),
           "lora_unet_a.alpha": torch.tensor(2.0),
           "lora_unet_norm.diff": torch.randn(8, generator=g) * 0.01}
    save_file(one, str(tmp_path / "one.safetensors"))
    save_file(two, str(tmp_path / "two.safetensors"))
    return [(str(tmp_path / "one.safetensors"), 0.8), (str(tmp_path / "two.safetensors"), -0.6)]


def reference(path, dtype, loras, model_cls=Net, **kw) -> nn.Module:
    """Load the checkpoint the ordinary way, then merge."""
    ref = model_cls().to(dtype)
    ref.load_state_dict(load_file(str(path)), strict=model_cls is not Tied)
    if loras:
        shuttle.merge_lora(ref, loras, **kw)
    return ref


def meta_model(dtype, model_cls=Net, **kw) -> nn.Module:
    with torch.device("meta"):
        return model_cls(**kw).to(dtype)


# -- equal to load + merge ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("meta", [True, False])
def test_equals_load_then_merge(tmp_path, dtype, meta):
    make_checkpoint(tmp_path / "ck.safetensors", dtype)
    loras = adapters(tmp_path)
    ref = reference(tmp_path / "ck.safetensors", dtype, loras)
    model = meta_model(dtype) if meta else Net().to(dtype)
    before = {n: p for n, p in model.named_parameters()}
    report = shuttle.load_checkpoint(model, tmp_path / "ck.safetensors", loras)
    assert_same(model, ref)
    assert sorted(report.patched) == ["a.bias", "a.weight", "b.weight", "norm.weight"]
    assert report.supplied == [] and report.unexpected == [] and report.unmatched == {}
    assert "bn.running_mean" in report.loaded and "bn.num_batches_tracked" in report.loaded
    assert model.cache.is_meta == meta  # non-persistent buffers are not the checkpoint's
    plain = reference(tmp_path / "ck.safetensors", dtype, [])
    assert bits(model.a.weight) != bits(plain.a.weight)  # the adapters did something
    for n, p in model.named_parameters():
        assert not p.is_meta and p.device.type == "cpu" and p.requires_grad
        if not meta:  # materialized already: overwritten in place, like load_state_dict
            assert p is before[n]


def test_one_rounding_from_the_checkpoint_values(tmp_path):
    """dtype= casts after the merge: float32 sum of the float32 checkpoint, rounded once."""
    sd = make_checkpoint(tmp_path / "ck.safetensors", torch.float32)
    loras = adapters(tmp_path)
    model = meta_model(torch.float32)
    shuttle.load_checkpoint(model, tmp_path / "ck.safetensors", loras, dtype=torch.bfloat16)
    diff = load_file(str(tmp_path / "one.safetensors"))["a.diff_b"]
    want = (sd["a.bias"] + 0.8 * diff).to(torch.bfloat16)
    assert bits(model.a.bias) == bits(want)
    assert model.bn.num_batches_tracked.dtype == torch.int64  # integers keep their dtype
    assert model.norm.bias.dtype == torch.bfloat16


def test_stochastic_rounding_matches_merge(tmp_path):
    make_checkpoint(tmp_path / "ck.safetensors", torch.bfloat16)
    loras = adapters(tmp_path)
    ref = reference(tmp_path / "ck.safetensors", torch.bfloat16, loras,
                    rounding="stochastic", seed=3)
    model = meta_model(torch.bfloat16)
    shuttle.load_checkpoint(model, tmp_path / "ck.safetensors", loras, rounding="stochastic",
                            seed=3)
    assert_same(model, ref)


def test_no_adapters_and_requires_grad_kept(tmp_path):
    make_checkpoint(tmp_path / "ck.safetensors", torch.float32)
    model = meta_model(torch.float32)
    model.norm.weight.requires_grad_(False)
    report = shuttle.load_checkpoint(model, tmp_path / "ck.safetensors", progress=True)
    assert_same(model, reference(tmp_path / "ck.safetensors", torch.float32, []))
    assert not model.norm.weight.requires_grad and model.a.weight.requires_grad
    assert isinstance(model.a.weight, nn.Parameter) and report.patched == []


def test_state_dict_source_is_not_changed(tmp_path):
    sd = make_checkpoint(tmp_path / "ck.safetensors", torch.float32)
    kept = {k: v.clone() for k, v in sd.items()}
    loras = adapters(tmp_path)
    model = meta_model(torch.float32)
    shuttle.load_checkpoint(model, sd, loras)
    assert_same(model, reference(tmp_path / "ck.safetensors", torch.float32, loras))
    assert all(bits(sd[k]) == bits(kept[k]) for k in sd)


# -- set_weight, tied weights, shards -------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_set_weight_supplies_a_missing_parameter(tmp_path, dtype, monkeypatch):
    make_checkpoint(tmp_path / "ck.safetensors", dtype)  # a Net without gate
    value = torch.randn(4, 8)
    save_file({"diffusion_model.gate.set_weight": value, "diffusion_model.a.diff_b":
               torch.randn(12) * 0.01}, str(tmp_path / "gate.safetensors"))
    gate = str(tmp_path / "gate.safetensors")
    model = meta_model(dtype, gate=True)
    report = shuttle.load_checkpoint(model, tmp_path / "ck.safetensors", [(gate, 0.5)])
    assert report.supplied == ["gate.weight"]
    assert sorted(report.patched) == ["a.bias", "gate.weight"]
    assert model.gate.weight.dtype == dtype and not model.gate.weight.is_meta
    assert bits(model.gate.weight) == bits((0.5 * value).to(dtype))
    ref = reference(tmp_path / "ck.safetensors", dtype, [])
    shuttle.merge_lora(ref, [(load_file(gate), 0.5)])  # the a.diff_b half, for comparison
    assert bits(model.a.bias) == bits(ref.a.bias)

    def no_read(*args, **kwargs):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(SafetensorsFile, "read", no_read)
    want = frozenset({"gate.weight"})
    assert shuttle.apply.replacement_parameters(gate, meta_model(dtype, gate=True)) == want
    names = [n for n, _ in Net(gate=True).named_parameters()]
    assert shuttle.apply.replacement_parameters(gate, names) == want
    assert shuttle.apply.replacement_parameters(gate, {n: (1,) for n in names}) == want
    assert shuttle.apply.replacement_parameters(gate, names[:-1]) == frozenset()


@pytest.mark.parametrize("stored_as", ["emb.weight", "head.weight"])
def test_tied_weights_stay_tied(tmp_path, stored_as):
    sd = make_checkpoint(tmp_path / "ck.safetensors", torch.float32, Tied)
    if stored_as == "head.weight":  # the checkpoint names the tied tensor by its other name
        sd["head.weight"] = sd.pop("emb.weight")
        save_file(sd, str(tmp_path / "ck.safetensors"))
    diff = torch.randn(10, 8) * 0.01
    save_file({"emb.diff": diff}, str(tmp_path / "d.safetensors"))
    model = meta_model(torch.float32, Tied)
    report = shuttle.load_checkpoint(model, tmp_path / "ck.safetensors",
                                     [(str(tmp_path / "d.safetensors"), 1.0)])
    assert model.head.weight is model.emb.weight and not model.emb.weight.is_meta
    assert bits(model.emb.weight) == bits(sd[stored_as] + diff)  # patched once, not twice
    assert report.patched == ["emb.weight"] and report.loaded.count(stored_as) == 1
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in Tied().named_parameters()]


def test_sharded_index_and_file_list(tmp_path):
    sd = make_checkpoint(tmp_path / "ck.safetensors", torch.bfloat16)
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: sd[k] for k in part}, str(tmp_path / name))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {
        k: name for name, part in shards.items() for k in part}}))
    loras = adapters(tmp_path)
    ref = reference(tmp_path / "ck.safetensors", torch.bfloat16, loras)
    for files in (index, [tmp_path / n for n in shards]):
        model = meta_model(torch.bfloat16)
        shuttle.load_checkpoint(model, files, loras)
        assert_same(model, ref)
    bad = json.loads(index.read_text())
    elsewhere = next(n for n, part in shards.items() if "a.weight" not in part)
    bad["weight_map"]["a.weight"] = elsewhere
    index.write_text(json.dumps(bad))
    with pytest.raises(CorruptFileError, match="a.weight"):
        shuttle.load_checkpoint(meta_model(torch.bfloat16), index, loras)


# -- the report -----------------------------------------------------------------------------------

def test_unmatched_dense_keys_are_loud(tmp_path, caplog):
    make_checkpoint(tmp_path / "ck.safetensors", torch.float32)
    ck = load_file(str(tmp_path / "ck.safetensors"))
    ck["old.weight"] = torch.ones(2)  # a key the model lacks
    save_file(ck, str(tmp_path / "ck.safetensors"))
    save_file({"a.diff": torch.randn(12, 16) * 0.01,
               "ghost.diff": torch.randn(5),                 # no such module
               "vsa.to_gate_compress.set_weight": torch.randn(3, 3),
               "norm.diff_b": torch.randn(8),                # has a bias: matches
               "a.lora_A.weight": torch.randn(2, 16),        # not dense: reported, not warned
               "a.lora_B.weight": torch.randn(12, 2)}, str(tmp_path / "x.safetensors"))
    model = meta_model(torch.float32)
    with caplog.at_level(logging.WARNING, logger="shuttle"):
        report = shuttle.load_checkpoint(model, tmp_path / "ck.safetensors",
                                         [(str(tmp_path / "x.safetensors"), 1.0)])
    assert set(report.dense_unmatched) == {"ghost.weight", "vsa.to_gate_compress.weight"}
    assert "set payload" in report.dense_unmatched["vsa.to_gate_compress.weight"]
    assert {"ghost", "vsa.to_gate_compress"} <= set(report.unmatched)
    text = caplog.text
    assert "'ghost.weight'" in text and "'vsa.to_gate_compress.weight'" in text
    assert "no module of the model matches" in text
    assert report.unexpected == ["old.weight"]
    assert sorted(report.patched) == ["a.weight", "norm.bias"]


# -- bad input: typed errors, model unchanged -----------------------------------------------------

def _bad_cases(tmp_path):
    """(name, model kwargs, checkpoint path, loras, kwargs, error, message regex)."""
    make_checkpoint(tmp_path / "ck.safetensors", torch.float32)
    good = adapters(tmp_path)[:1]
    ck = load_file(str(tmp_path / "ck.safetensors"))
    lacking = dict(ck)
    del lacking["b.weight"]
    save_file(lacking, str(tmp_path / "lacking.safetensors"))
    wrong = dict(ck, **{"b.weight": torch.zeros(8, 13)})
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    integer = dict(ck, **{"norm.weight": torch.zeros(8, dtype=torch.int32)})
    save_file(integer, str(tmp_path / "integer.safetensors"))
    for name, value in (("set1", 1.0), ("set2", 2.0)):
        save_file({"gate.set_weight": torch.full((4, 8), value)},
                  str(tmp_path / f"{name}.safetensors"))
    save_file({"b.diff": torch.randn(8, 11)}, str(tmp_path / "badshape.safetensors"))
    save_file({"b.diff": torch.tensor([[math.nan] * 12] * 8)}, str(tmp_path / "nan.safetensors"))
    ckp = tmp_path / "ck.safetensors"
    s = lambda n: str(tmp_path / f"{n}.safetensors")  # noqa: E731
    return [
        ("missing param", {}, tmp_path / "lacking.safetensors", good, {}, MissingParameterError,
         "'b.weight'"),
        ("set needs whole", {"gate": True}, ckp, good, {}, MissingParameterError, "'gate.weight'"),
        ("two sets", {"gate": True}, ckp, good + [(s("set1"), 1.0), (s("set2"), 1.0)], {},
         DuplicateTargetError, "gate.weight"),
        ("nan strength", {}, ckp, good + [(s("badshape"), math.nan)], {}, InvalidStrengthError,
         "nan"),
        ("inf strength", {}, ckp, [(good[0][0], math.inf)], {}, InvalidStrengthError, "inf"),
        ("no adapter file", {}, ckp, good + [(s("absent"), 1.0)], {}, AdapterFileError, "absent"),
        ("no checkpoint", {}, tmp_path / "absent.safetensors", good, {}, AdapterFileError,
         "absent"),
        ("checkpoint shape", {}, tmp_path / "wrong.safetensors", good, {}, ShapeMismatchError,
         "b.weight"),
        ("adapter shape", {}, ckp, good + [(s("badshape"), 1.0)], {}, ShapeMismatchError,
         "'b.weight'"),
        ("nan adapter", {}, ckp, good + [(s("nan"), 1.0)], {}, NonFiniteAdapterError,
         "'b.weight'"),
        ("integer", {}, tmp_path / "integer.safetensors", good, {}, UnsupportedLayerError,
         "norm.weight"),
        ("rounding", {}, ckp, good, {"rounding": "up"}, InvalidOptionError, "rounding"),
    ]


@pytest.mark.parametrize("meta", [False, True])
def test_bad_input_leaves_the_model_unchanged(tmp_path, meta):
    for name, kw, ck, loras, extra, error, match in _bad_cases(tmp_path):
        model = meta_model(torch.float32, **kw) if meta else Net(**kw)
        before = model_hash(model)
        with pytest.raises(error, match=match):
            shuttle.load_checkpoint(model, ck, loras, **extra)
        assert model_hash(model) == before, name


def test_not_strict_leaves_missing_tensors(tmp_path):
    make_checkpoint(tmp_path / "ck.safetensors", torch.float32)
    ck = load_file(str(tmp_path / "ck.safetensors"))
    del ck["b.weight"]
    save_file(ck, str(tmp_path / "lacking.safetensors"))
    model = Net()
    old = model.b.weight.detach().clone()
    report = shuttle.load_checkpoint(model, tmp_path / "lacking.safetensors", strict=False)
    assert report.missing == ["b.weight"] and bits(model.b.weight) == bits(old)
    assert bits(model.a.weight) == bits(ck["a.weight"])


def test_overflow_found_at_its_tensor(tmp_path):
    make_checkpoint(tmp_path / "ck.safetensors", torch.float16)
    save_file({"b.diff": torch.full((8, 12), 60000.0)}, str(tmp_path / "big.safetensors"))
    with pytest.raises(NonFiniteAdapterError, match="'b.weight'.*Loading stopped"):
        shuttle.load_checkpoint(meta_model(torch.float16), tmp_path / "ck.safetensors",
                                [(str(tmp_path / "big.safetensors"), 2.0)])


# -- peak host memory -----------------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    import shuttle

    def status(field):  # bytes, from /proc/self/status (Linux)
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    # VmHWM is this process's high-water mark of resident memory. (ru_maxrss would do, but it
    # carries over the parent's high-water mark through fork and exec.)
    peak = lambda: status("VmHWM")  # noqa: E731
    now = lambda: status("VmRSS")  # noqa: E731

    ck, adapter, n, side = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with torch.device("meta"):
        model = nn.ModuleList(nn.Linear(side, side, bias=False) for _ in range(n))
    base = now()
    report = shuttle.load_checkpoint(model, ck, [(adapter, 0.5)])
    top = peak()
    kept = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"base": base, "peak": top, "kept": kept, "patched": report.patched}))
""")


def _write_streaming(path, tensors: dict[str, tuple[int, int]], make) -> int:
    """A float32 safetensors file written one tensor at a time (the test's own memory stays
    at one tensor); returns the data bytes."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for i, shape in enumerate(tensors.values()):
            f.write(memoryview(make(i, shape).numpy()))
    return offset


def test_peak_memory_is_a_few_tensors_not_the_checkpoint(tmp_path):
    n, side = 16, 4096  # 16 tensors of 64 MiB: a 1 GiB checkpoint
    names = {f"{i}.weight": (side, side) for i in range(n)}
    size = _write_streaming(tmp_path / "ck.safetensors", names,
                            lambda i, shape: torch.full(shape, float(i)))
    # The patch lands on the last tensor read, so its merge's working memory stacks on top of
    # an almost fully loaded model.
    save_file({f"{n - 1}.diff": torch.full((side, side), 0.25)}, str(tmp_path / "ad.safetensors"))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "ck.safetensors"),
                          str(tmp_path / "ad.safetensors"), str(n), str(side)],
                         capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["patched"] == [f"{n - 1}.weight"] and r["kept"] == size
    # The loaded model itself must be resident (the device is the CPU here); everything else
    # the load needed at its peak is its working memory.
    working = r["peak"] - r["base"] - r["kept"]
    print(f"checkpoint {size / 2**20:.0f} MiB, working memory at peak {working / 2**20:.0f} MiB")
    assert working < 0.4 * size


def test_a_dense_payload_split_by_rows_is_not_reported_unmatched(tmp_path, caplog):
    """A kohya ``.diff`` on BFL's fused ``img_attn.qkv`` lands on diffusers' split q/k/v as
    row-sliced payloads: applied, and therefore not listed (or logged) as unmatched."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8])
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    diff = torch.randn(96, 32, generator=torch.Generator().manual_seed(1))
    lora = shuttle.load_lora({"lora_unet_double_blocks_0_img_attn_qkv.diff": diff})
    fresh = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="shuttle"):
        report = shuttle.load_checkpoint(fresh, tmp_path / "model.safetensors",
                                         loras=[(lora, 0.5)])
    assert report.dense_unmatched == {} and "was not loaded" not in caplog.text
    for i, name in enumerate(("to_q", "to_k", "to_v")):
        got = getattr(fresh.transformer_blocks[0].attn, name).weight
        want = getattr(model.transformer_blocks[0].attn, name).weight + 0.5 * diff[32 * i:][:32]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
