"""merge_files against the in-memory merge: every tensor bit for bit; shards, index, metadata;
inputs checked before anything is written; a failure never replaces an existing output."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import shuttle
from shuttle.apply.merge_files import merge_files
from shuttle.apply.rounding import round_to
from shuttle.errors import (
    AdapterFileError,
    CheckpointError,
    CorruptFileError,
    DuplicateTargetError,
    InvalidOptionError,
    InvalidStrengthError,
    NonFiniteAdapterError,
    ShapeMismatchError,
    ShuttleError,
)
from tests import assert_bits_equal

# The module, not the function that shuttle.apply re-exports under the same name.
merge_files_mod = importlib.import_module("shuttle.apply.merge_files")

def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        assert_bits_equal(got[k], w, k)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 48)
        self.blocks = nn.ModuleList([nn.Linear(48, 48) for _ in range(2)])
        self.norm = nn.LayerNorm(48)
        self.out = nn.Linear(48, 16)
        self.register_buffer("step", torch.arange(3))  # an integer tensor: copied as it is


def _model(dtype: torch.dtype) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def _adapters(tmp_path) -> list[str]:
    g = torch.Generator().manual_seed(1)
    kohya = {
        "lora_unet_blocks_0.lora_down.weight": torch.randn(4, 48, generator=g) * 0.1,
        "lora_unet_blocks_0.lora_up.weight": torch.randn(48, 4, generator=g) * 0.1,
        "lora_unet_blocks_0.alpha": torch.tensor(2.0),
        "lora_unet_proj.lora_down.weight": torch.randn(8, 32, generator=g) * 0.1,
        "lora_unet_proj.lora_up.weight": torch.randn(48, 8, generator=g) * 0.1,
        "lora_unet_norm.diff_b": torch.randn(48, generator=g) * 0.01,
    }
    peft = {
        "blocks.0.lora_A.weight": (torch.randn(2, 48, generator=g) * 0.1).bfloat16(),
        "blocks.0.lora_B.weight": (torch.randn(48, 2, generator=g) * 0.1).bfloat16(),
        "out.lora_A.weight": (torch.randn(2, 48, generator=g) * 0.1).bfloat16(),
        "out.lora_B.weight": (torch.randn(16, 2, generator=g) * 0.1).bfloat16(),
    }
    paths = [str(tmp_path / "kohya.safetensors"), str(tmp_path / "peft.safetensors")]
    save_file(kohya, paths[0])
    save_file(peft, paths[1])
    return paths


def _base(tmp_path, dtype: torch.dtype, metadata: dict[str, str] | None = None) -> str:
    path = str(tmp_path / f"base_{str(dtype)[6:]}.safetensors")
    save_file(_model(dtype).state_dict(), path, metadata=metadata)
    return path


def _reference(dtype: torch.dtype, loras, **kwargs) -> dict[str, torch.Tensor]:
    model = _model(dtype)
    shuttle.merge_lora(model, loras, **kwargs)
    return {k: v.detach() for k, v in model.state_dict().items()}


# -- equal to the in-memory merge ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rounding", "seed"), [("nearest", None), ("stochastic", 7)])
def test_equals_in_memory_merge(tmp_path, dtype, rounding, seed):
    a, b = _adapters(tmp_path)
    loras = [(a, 0.8), (b, 0.5)]
    out = tmp_path / "merged.safetensors"
    report = merge_files(_base(tmp_path, dtype), loras, out, rounding=rounding, seed=seed)
    want = _reference(dtype, loras, rounding=rounding, seed=seed)
    got = load_file(str(out))
    assert_same_tensors(got, want)
    assert report.files == [out] and report.index is None
    assert sorted(report.applied) == ["blocks.0.weight", "norm.bias", "out.weight", "proj.weight"]
    assert report.unmatched == {}
    base = load_file(_base(tmp_path, dtype))
    assert not torch.equal(got["blocks.0.weight"], base["blocks.0.weight"])
    assert torch.equal(got["blocks.1.weight"], base["blocks.1.weight"])


def test_stochastic_is_repeatable_and_seeded(tmp_path):
    a, b = _adapters(tmp_path)
    base = _base(tmp_path, torch.bfloat16)
    runs = []
    for i, seed in enumerate([3, 3, 4]):
        out = tmp_path / f"m{i}.safetensors"
        merge_files(base, [(a, 0.8), (b, 0.5)], out, rounding="stochastic", seed=seed)
        runs.append(load_file(str(out)))
    assert_same_tensors(runs[0], runs[1])
    assert not torch.equal(runs[0]["blocks.0.weight"], runs[2]["blocks.0.weight"])


@pytest.mark.parametrize("out_dtype", ["bf16", "fp16", "fp32", "fp8_e4m3fn", torch.bfloat16])
def test_dtype_conversion_rounds_once(tmp_path, out_dtype):
    a, b = _adapters(tmp_path)
    loras = [(a, 0.8), (b, 0.5)]
    out = tmp_path / "merged.safetensors"
    merge_files(_base(tmp_path, torch.float32), loras, out, dtype=out_dtype)
    target = out_dtype if isinstance(out_dtype, torch.dtype) else \
        merge_files_mod.OUTPUT_DTYPES[out_dtype]
    # A float32 merge is exact in float32; its one rounding is the conversion, by the default
    # for the output dtype: nearest, stochastic into float8.
    nearest = {k: v.to(target) if v.is_floating_point() else v
               for k, v in _reference(torch.float32, loras).items()}
    if target != torch.float8_e4m3fn:
        assert_same_tensors(load_file(str(out)), nearest)
        return
    stochastic = tmp_path / "stochastic.safetensors"
    merge_files(_base(tmp_path, torch.float32), loras, stochastic, dtype=out_dtype,
                rounding="stochastic")
    assert_same_tensors(load_file(str(out)), load_file(str(stochastic)))
    got = load_file(str(out))
    assert any(not torch.equal(got[k].float(), v.float()) for k, v in nearest.items()
               if v.is_floating_point())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_stochastic_dtype_conversion_is_seeded_by_name(tmp_path, out_dtype):
    """Without adapters a tensor's seed is its name and ``seed`` (with adapters, their
    fingerprints too: test_equals_in_memory_merge)."""
    base = _base(tmp_path, torch.float32)
    out = tmp_path / "converted.safetensors"
    merge_files(base, [], out, dtype=out_dtype, rounding="stochastic", seed=5)
    want = {k: round_to(v, out_dtype, "stochastic", k, 5) if v.is_floating_point() else v
            for k, v in load_file(str(base)).items()}
    assert_same_tensors(load_file(str(out)), want)


def test_no_adapters_is_a_conversion(tmp_path):
    out = tmp_path / "bf16.safetensors"
    report = merge_files(_base(tmp_path, torch.float32), [], out, dtype="bf16")
    want = {k: v.bfloat16() if v.is_floating_point() else v
            for k, v in _model(torch.float32).state_dict().items()}
    assert_same_tensors(load_file(str(out)), want)
    assert report.applied == [] and json.loads(report.metadata["shuttle.adapters"]) == []


# -- shards, index, metadata ---------------------------------------------------------------------

def test_shards_and_index_round_trip(tmp_path):
    a, b = _adapters(tmp_path)
    loras = [(a, 0.8), (b, 0.5)]
    base = _base(tmp_path, torch.bfloat16)
    single = tmp_path / "single.safetensors"
    merge_files(base, loras, single)
    limit = 48 * 48 * 2 + 100  # about one block weight per shard
    out_dir = tmp_path / "sharded"
    report = merge_files(base, loras, out_dir, max_shard_bytes=limit)
    n = len(report.files)
    assert n > 2
    assert report.files == [out_dir / f"model-{i:05d}-of-{n:05d}.safetensors"
                            for i in range(1, n + 1)]
    assert report.index == out_dir / "model.safetensors.index.json"
    index = json.loads(report.index.read_text())
    want = load_file(str(single))
    assert list(index["weight_map"]) == list(want)  # checkpoint order
    assert set(index["weight_map"].values()) == {p.name for p in report.files}
    got: dict[str, torch.Tensor] = {}
    for path in report.files:
        part = load_file(str(path))
        assert sum(t.numel() * t.element_size() for t in part.values()) <= limit
        assert all(index["weight_map"][k] == path.name for k in part)
        got.update(part)
    assert_same_tensors(got, want)
    assert index["metadata"]["total_size"] == report.total_size == \
        sum(t.numel() * t.element_size() for t in want.values())
    assert sorted(p.name for p in out_dir.iterdir()) == \
        sorted([p.name for p in report.files] + [report.index.name])  # no temporaries left
    # The sharded output reads back as a base, by its index or its file list.
    for again_base in (report.index, [str(p) for p in report.files]):
        again = tmp_path / "again.safetensors"
        merge_files(again_base, [], again)
        assert_same_tensors(load_file(str(again)), want)


def test_sharded_output_named_after_a_file(tmp_path):
    base = _base(tmp_path, torch.float32)
    report = merge_files(base, [], tmp_path / "out" / "flux.safetensors", max_shard_bytes=4096)
    assert report.index == tmp_path / "out" / "flux.safetensors.index.json"
    assert report.files[0].name.startswith("flux-00001-of-")


def test_a_tensor_larger_than_the_shard_size_gets_its_own_file(tmp_path):
    report = merge_files(_base(tmp_path, torch.float32), [], tmp_path / "o", max_shard_bytes=8)
    assert len(report.files) == len(_model(torch.float32).state_dict())


def test_metadata_records_the_merge(tmp_path):
    a, b = _adapters(tmp_path)
    base = _base(tmp_path, torch.float32, metadata={"modelspec.title": "base"})
    out = tmp_path / "merged.safetensors"
    report = merge_files(base, [(a, 0.8), (b, 0.0), (b, 0.5)], out, dtype="bf16",
                         rounding="stochastic", seed=9)
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta == report.metadata
    assert meta["modelspec.title"] == "base" and meta["format"] == "pt"
    assert meta["shuttle.version"] == shuttle.__version__
    assert meta["shuttle.rounding"] == "stochastic" and meta["shuttle.seed"] == "9"
    assert meta["shuttle.dtype"] == "bfloat16"
    adapters = json.loads(meta["shuttle.adapters"])
    assert [(x["source"], x["strength"]) for x in adapters] == [(a, 0.8), (b, 0.5)]  # 0 skipped


# -- bad inputs raise before anything is written --------------------------------------------------

def _bad_cases(tmp_path):
    a, _ = _adapters(tmp_path)
    base = _base(tmp_path, torch.float32)
    g = torch.Generator().manual_seed(0)
    wrong = str(tmp_path / "wrong.safetensors")
    save_file({"blocks.0.lora_A.weight": torch.randn(2, 7, generator=g),
               "blocks.0.lora_B.weight": torch.randn(48, 2, generator=g)}, wrong)
    dup = str(tmp_path / "dup.safetensors")
    save_file({"blocks.0.lora_A.weight": torch.randn(2, 48, generator=g),
               "blocks.0.lora_B.weight": torch.randn(48, 2, generator=g),
               "lora_unet_blocks_0.lora_down.weight": torch.randn(2, 48, generator=g),
               "lora_unet_blocks_0.lora_up.weight": torch.randn(48, 2, generator=g)}, dup)
    index = tmp_path / "bad.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"proj.weight": "missing.safetensors"}}))
    liar = tmp_path / "liar.safetensors.index.json"
    liar.write_text(json.dumps({"weight_map": {"nope": "base_float32.safetensors"}}))
    notjson = tmp_path / "notjson.safetensors.index.json"
    notjson.write_text("{")
    return [
        (AdapterFileError, dict(base=tmp_path / "nope.safetensors", loras=[(a, 1.0)])),
        (AdapterFileError, dict(base=index, loras=[(a, 1.0)])),
        (CorruptFileError, dict(base=liar, loras=[(a, 1.0)])),
        (CorruptFileError, dict(base=notjson, loras=[(a, 1.0)])),
        # a directory of several indexes: which one is ambiguous
        (AdapterFileError, dict(base=tmp_path, loras=[(a, 1.0)])),
        (AdapterFileError, dict(base=[], loras=[(a, 1.0)])),
        (CheckpointError, dict(base=[base, base], loras=[(a, 1.0)])),
        (AdapterFileError, dict(base=base, loras=[(tmp_path / "missing.safetensors", 1.0)])),
        (InvalidStrengthError, dict(base=base, loras=[(a, float("nan"))])),
        (InvalidStrengthError, dict(base=base, loras=[(a, "0.5")])),
        (ShapeMismatchError, dict(base=base, loras=[(wrong, 1.0)])),
        (DuplicateTargetError, dict(base=base, loras=[(dup, 1.0)])),
        (ShuttleError, dict(base=base, loras=[(a, 1.0)], dtype="int8")),
        (ShuttleError, dict(base=base, loras=[(a, 1.0)], dtype=torch.float64)),
        (InvalidOptionError, dict(base=base, loras=[(a, 1.0)], rounding="up")),
        (ShuttleError, dict(base=base, loras=[(a, 1.0)], max_shard_bytes=0)),
    ]


def test_bad_inputs_raise_typed_errors_and_write_nothing(tmp_path):
    for error, kwargs in _bad_cases(tmp_path):
        before = sorted(p.name for p in tmp_path.iterdir())
        out = tmp_path / "out" / "merged.safetensors"
        with pytest.raises(error):
            merge_files(out=out, **kwargs)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, kwargs


def test_bad_out_paths(tmp_path):
    base = _base(tmp_path, torch.float32)
    (tmp_path / "dir.safetensors").mkdir()
    (tmp_path / "plainfile").write_text("x")
    with pytest.raises(ShuttleError, match="directory"):
        merge_files(base, [], tmp_path / "dir.safetensors")
    with pytest.raises(ShuttleError, match="suffix"):
        merge_files(base, [], tmp_path / "plainfile")


# -- failures while writing leave the old output -------------------------------------------------

def _existing_output(tmp_path, **kwargs):
    a, b = _adapters(tmp_path)
    base = _base(tmp_path, torch.bfloat16)
    out = tmp_path / "out"
    report = merge_files(base, [(a, 1.0)], out, **kwargs)
    saved = {p: p.read_bytes() for p in out.iterdir()}
    assert set(saved) == set(report.files) | ({report.index} if report.index else set())
    return base, (a, b), out, saved


@pytest.mark.parametrize("shard_bytes", [5 * 2**30, 4096])
def test_failure_midway_leaves_the_existing_output(tmp_path, monkeypatch, shard_bytes):
    base, (a, b), out, saved = _existing_output(tmp_path, max_shard_bytes=shard_bytes)
    calls = []
    real = merge_files_mod._merged

    def failing(t, name, *args):
        calls.append(name)
        if len(calls) == 5:
            raise RuntimeError("disk full")
        return real(t, name, *args)

    monkeypatch.setattr(merge_files_mod, "_merged", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        merge_files(base, [(a, 0.5), (b, 0.5)], out, max_shard_bytes=shard_bytes)
    assert len(calls) == 5
    assert {p: p.read_bytes() for p in out.iterdir()} == saved  # same files, same bytes


def test_non_finite_adapter_found_while_writing_leaves_the_output(tmp_path):
    base, (a, _), out, saved = _existing_output(tmp_path)
    nan = str(tmp_path / "nan.safetensors")
    save_file({"out.lora_A.weight": torch.full((2, 48), float("nan")),
               "out.lora_B.weight": torch.ones(16, 2)}, nan)
    with pytest.raises(NonFiniteAdapterError, match="out.weight"):
        merge_files(base, [(a, 1.0), (nan, 1.0)], out)
    assert {p: p.read_bytes() for p in out.iterdir()} == saved


@pytest.mark.parametrize("dtype", ["fp16", "fp8_e4m3fn"])
def test_overflowing_the_output_dtype_raises(tmp_path, dtype):
    base = str(tmp_path / "big.safetensors")
    save_file({"w": torch.full((4, 4), 1e6)}, base)
    with pytest.raises(NonFiniteAdapterError, match="beyond the range"):
        merge_files(base, [], tmp_path / "o.safetensors", dtype=dtype)
    assert not (tmp_path / "o.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]


def test_adapter_tensors_are_read_only_while_merging(tmp_path, monkeypatch):
    """Planning reads headers; each adapter tensor is read when its base tensor is merged."""
    from shuttle.formats.safetensors_file import LazyTensor

    a, b = _adapters(tmp_path)
    base = _base(tmp_path, torch.float32)
    reads: list[str] = []
    real = LazyTensor.load
    monkeypatch.setattr(LazyTensor, "load",
                        lambda self, **kw: reads.append(self.key) or real(self, **kw))
    monkeypatch.setattr(merge_files_mod, "_merged", _raise_on_call)
    with pytest.raises(AssertionError, match="first tensor"):
        merge_files(base, [(a, 1.0), (b, 1.0)], tmp_path / "o.safetensors")
    # load_lora reads 0-dim alphas with the header; no factor or payload is read.
    assert [k for k in reads if ("lora" in k or "diff" in k) and "alpha" not in k] == []


def _raise_on_call(*args, **kwargs):
    raise AssertionError("first tensor")


def test_files_of_an_earlier_output_are_reported(tmp_path, caplog):
    base = _base(tmp_path, torch.float32)
    out = tmp_path / "out" / "m.safetensors"
    merge_files(base, [], out, max_shard_bytes=4096)
    caplog.clear()
    merge_files(base, [], out)  # one file now: the old shards and index remain
    assert "m.safetensors.index.json" in caplog.text and "m-00001-of-" in caplog.text
    caplog.clear()
    merge_files(base, [], tmp_path / "fresh.safetensors")
    assert "earlier output" not in caplog.text


# -- the inputs' index, temporary names ----------------------------------------------------------

@pytest.mark.parametrize("given_as", ["index", "folder", "shards"])
def test_the_inputs_index_is_never_overwritten(tmp_path, caplog, given_as):
    """A sharded base merged into its own folder under another shard count: no shard name
    collides, only ``model.safetensors.index.json``, the inputs' own index (also when the base
    is given by its shards, which that index names)."""
    from shuttle.errors import OutputIsInputError

    sharded = merge_files(_base(tmp_path, torch.float32), [], tmp_path / "ckpt",
                          max_shard_bytes=4096)
    assert len(sharded.files) > 2  # the output below has 2 shards: other names
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    base = {"index": sharded.index, "folder": tmp_path / "ckpt",
            "shards": [str(p) for p in sharded.files]}[given_as]
    with pytest.raises(OutputIsInputError, match=r"model\.safetensors\.index\.json' would "
                                                 "overwrite the input"):
        merge_files(base, [], tmp_path / "ckpt", max_shard_bytes=16384)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    # one output file beside them replaces nothing, and the inputs are not called stale
    caplog.clear()
    merge_files(base, [], tmp_path / "ckpt" / "model.safetensors")
    assert "earlier output" not in caplog.text


def test_temporaries_carry_the_prefix_stale_ones_are_found_by(tmp_path, monkeypatch):
    """While a sharded merge writes, its files (shards, then the index) exist only under
    ``.shuttle-partial.`` names; an error removes them."""
    from shuttle.formats import safetensors_writer
    from shuttle.formats.safetensors_writer import TEMP_PREFIX

    base = _base(tmp_path, torch.float32)
    out = tmp_path / "out"
    seen: list[list[str]] = []
    real = safetensors_writer.SafetensorsWriter.write

    def write(self, name, tensor):
        seen.append(sorted(p.name for p in out.iterdir()))
        return real(self, name, tensor)

    monkeypatch.setattr(safetensors_writer.SafetensorsWriter, "write", write)
    real_replace = merge_files_mod.os.replace

    def replace(src, dst):
        seen.append(sorted(p.name for p in out.iterdir()))
        raise OSError("disk full")

    monkeypatch.setattr(merge_files_mod.os, "replace", replace)
    with pytest.raises(OSError, match="disk full"):
        merge_files(base, [], out, max_shard_bytes=4096)
    monkeypatch.setattr(merge_files_mod.os, "replace", real_replace)
    assert seen and all(names and all(n.startswith(TEMP_PREFIX) for n in names)
                        for names in seen), seen
    assert any(n.endswith(".json") for n in seen[-1])  # the index's temporary too
    assert list(out.iterdir()) == []
