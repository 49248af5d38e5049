"""extract_lora: the adapter it writes, merged into the base, gives back the tuned model.

Dense payloads (``.diff``, ``.set_weight``) must reproduce the tuned weights bit for bit; low-rank
ones within the relative error the report states, which is checked against the merge itself.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import shuttle
from shuttle.apply import extract as extract_mod
from shuttle.errors import (
    AdapterFileError,
    CheckpointError,
    NonFiniteAdapterError,
    ShapeMismatchError,
)
from shuttle.formats.safetensors_file import SafetensorsFile

RANK = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(48, 64)  # exact rank-3 delta: lora, recovered exactly
        self.mlp = nn.Linear(40, 56)  # full-rank delta: lora with a stated error
        self.conv = nn.Conv2d(8, 16, 3)  # lora on (16, 8*3*3)
        self.conv1d = nn.Conv1d(6, 12, 5)  # lora on (12, 6*5)
        self.norm = nn.LayerNorm(64)  # diff / diff_b
        self.small = nn.Linear(6, 4)  # smaller dimension <= rank: diff
        self.pos = nn.Parameter(torch.zeros(3, 5))  # not a .weight: diff under its own name
        self.same = nn.Linear(4, 4)  # unchanged: nothing written
        self.gate = nn.Linear(5, 7)  # only in tuned: set_weight


def _checkpoints(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    tuned = {k: v.detach().clone() for k, v in Net().state_dict().items()}
    for v in tuned.values():
        v.copy_(torch.randn(v.shape, generator=g))
    base = {k: v.clone() for k, v in tuned.items() if not k.startswith("gate.")}
    tuned["proj.weight"] += torch.randn(64, 3, generator=g) @ torch.randn(3, 48, generator=g)
    for name in ("mlp.weight", "conv.weight", "conv1d.weight", "norm.weight", "norm.bias",
                 "small.weight", "proj.bias"):
        tuned[name] += 0.05 * torch.randn(tuned[name].shape, generator=g)
    tuned["pos"] += torch.randn(3, 5, generator=g)
    return base, tuned


def _merged(base: dict[str, torch.Tensor], adapter) -> dict[str, torch.Tensor]:
    model = Net()
    model.load_state_dict(base, strict=False)  # gate keeps its init: the adapter sets it
    report = shuttle.merge_lora(model, [(adapter, 1.0)])
    assert not report.unmatched
    return {k: v.detach() for k, v in model.state_dict().items()}


def _save(sd: dict[str, torch.Tensor], path) -> str:
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return str(path)


def _assert_reproduces(report, base, tuned, merged) -> None:
    for row in report.rows:
        got, want = merged[row.name], tuned[row.name]
        if row.kind in ("diff", "set", "identical"):
            assert row.error == 0.0 and row.energy == 1.0, row
            assert torch.equal(got, want), row.name
        else:
            assert row.kind == "lora"
            err = float((got - want).norm())
            # The merge adds float32 rounding of the weight itself to the stated error.
            slack = 1e-6 * float(want.norm())
            assert err <= row.error * row.delta_norm * 1.001 + slack, (row, err)
            assert err >= row.error * row.delta_norm * 0.999 - slack, (row, err)


# -- the round trip -------------------------------------------------------------------------------

def test_extract_then_merge_reproduces_tuned(tmp_path):
    base, tuned = _checkpoints()
    out = tmp_path / "adapter.safetensors"
    report = shuttle.extract_lora(_save(base, tmp_path / "b.safetensors"),
                                  _save(tuned, tmp_path / "t.safetensors"), out, rank=RANK)
    assert report.path == out and out.is_file()
    kinds = {r.name: r.kind for r in report.rows}
    assert kinds == {
        "proj.weight": "lora", "proj.bias": "diff", "mlp.weight": "lora", "mlp.bias": "identical",
        "conv.weight": "lora", "conv.bias": "identical", "conv1d.weight": "lora",
        "conv1d.bias": "identical", "norm.weight": "diff", "norm.bias": "diff",
        "small.weight": "diff", "small.bias": "identical", "pos": "diff",
        "same.weight": "identical", "same.bias": "identical", "gate.weight": "set",
        "gate.bias": "set",
    }
    _assert_reproduces(report, base, tuned, _merged(base, out))
    assert report.base_only == [] and report.skipped == {}
    assert report.bytes == sum(r.bytes for r in report.rows) < report.dense_bytes


def test_keys_are_comfyui_spelling(tmp_path):
    base, tuned = _checkpoints()
    out = tmp_path / "a.safetensors"
    shuttle.extract_lora(base, tuned, out, rank=RANK)
    with safe_open(str(out), "pt") as f:  # the reference reader accepts the file
        keys = set(f.keys())
        meta = f.metadata()
        alpha = f.get_tensor("proj.alpha")
        up, down = f.get_tensor("conv.lora_up.weight"), f.get_tensor("conv.lora_down.weight")
        up1, down1 = f.get_tensor("conv1d.lora_up.weight"), f.get_tensor("conv1d.lora_down.weight")
    assert keys == {
        "proj.lora_up.weight", "proj.lora_down.weight", "proj.alpha", "proj.diff_b",
        "mlp.lora_up.weight", "mlp.lora_down.weight", "mlp.alpha",
        "conv.lora_up.weight", "conv.lora_down.weight", "conv.alpha",
        "conv1d.lora_up.weight", "conv1d.lora_down.weight", "conv1d.alpha",
        "norm.diff", "norm.diff_b", "small.diff", "pos.diff",
        "gate.set_weight", "gate.bias.set_weight",
    }
    assert float(alpha) == 3.0  # alpha = rank: scale 1
    assert up.shape == (16, RANK, 1, 1) and down.shape == (RANK, 8, 3, 3)
    assert up1.shape == (12, RANK, 1) and down1.shape == (RANK, 6, 5)
    assert meta["shuttle_extract_rank"] == str(RANK) and meta["shuttle_extract_seed"] == "0"
    assert meta["shuttle_extract_base"] == "<state dict>"
    lora = shuttle.load_lora(out)
    assert lora.kinds() == {"lora": 4, "diff": 5, "set": 2}


def test_in_memory_result_and_prefix():
    base, tuned = _checkpoints()
    report = shuttle.extract_lora(base, tuned, rank=RANK, prefix="diffusion_model.")
    assert report.path is None and report.tensors is not None
    assert all(k.startswith("diffusion_model.") for k in report.tensors)
    _assert_reproduces(report, base, tuned, _merged(base, report.tensors))
    value = report.tensors["diffusion_model.gate.set_weight"]
    assert value.data_ptr() != tuned["gate.weight"].data_ptr()  # a copy, not the input


def test_any_prefix_reads_back_through_a_mapping():
    base, tuned = _checkpoints()
    report = shuttle.extract_lora(base, tuned, rank=RANK, prefix="my_model.")
    model = Net()
    model.load_state_dict(base, strict=False)
    merged = shuttle.merge_lora(model, [(report.tensors, 1.0)],
                                mapping=lambda m: m.removeprefix("my_model."))
    assert not merged.unmatched
    assert torch.equal(model.norm.weight.detach(), tuned["norm.weight"])


def test_exact_low_rank_delta_is_recovered():
    g = torch.Generator().manual_seed(1)
    base = {"m.weight": torch.randn(96, 80, generator=g)}
    delta = torch.randn(96, 3, generator=g) @ torch.randn(3, 80, generator=g)
    tuned = {"m.weight": base["m.weight"] + delta}
    for rank in (3, 8, 20):
        report = shuttle.extract_lora(base, tuned, rank=rank)
        (row,) = report.rows
        assert row.kind == "lora" and row.rank == 3  # zero singular values are dropped
        assert row.error < 1e-5 and row.energy > 1 - 1e-6
        up, down = report.tensors["m.lora_up.weight"], report.tensors["m.lora_down.weight"]
        exact = (tuned["m.weight"].double() - base["m.weight"].double())
        assert torch.allclose((up.double() @ down.double()), exact, rtol=0, atol=1e-4)


def _known_spectrum(m: int, n: int, s: list[float], seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, len(s), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, len(s), generator=g, dtype=torch.float64))
    return (u * torch.tensor(s, dtype=torch.float64)) @ v.T


@pytest.mark.parametrize(("energy", "rank"), [(0.5, 1), (0.95, 2), (0.99, 3), (0.999, 4)])
def test_energy_picks_the_smallest_sufficient_rank(energy, rank):
    s = [10.0, 5.0, 2.0, 1.0, 0.1, 0.01]  # s^2 cumulative: 0.769, 0.961, 0.992, 0.99992, ...
    delta = _known_spectrum(120, 100, s)
    base = {"m.weight": torch.zeros(120, 100)}
    tuned = {"m.weight": delta.float()}
    (row,) = shuttle.extract_lora(base, tuned, energy=energy).rows
    expect = sum(x * x for x in s[:rank]) / sum(x * x for x in s)
    assert row.kind == "lora" and row.rank == rank
    assert row.energy == pytest.approx(expect, abs=1e-5)
    assert row.error == pytest.approx(math.sqrt(1 - expect), rel=1e-3)


def test_energy_is_capped_where_factors_stop_saving_bytes():
    g = torch.Generator().manual_seed(3)
    base = {"m.weight": torch.zeros(24, 20)}
    tuned = {"m.weight": torch.randn(24, 20, generator=g)}  # full rank, flat spectrum
    (row,) = shuttle.extract_lora(base, tuned, energy=0.999).rows
    r_max = (24 * 20 - 1) // (24 + 20)
    assert row.kind == "lora" and row.rank == r_max and row.energy < 0.999
    assert row.bytes < row.dense_bytes and "capped" in row.note


def test_rank_that_saves_no_bytes_writes_a_diff():
    g = torch.Generator().manual_seed(4)
    base = {"m.weight": torch.randn(12, 10, generator=g)}
    tuned = {"m.weight": base["m.weight"] + torch.randn(12, 10, generator=g)}
    (row,) = shuttle.extract_lora(base, tuned, rank=6).rows  # 6 * 22 > 120
    assert row.kind == "diff" and "not smaller" in row.note


def test_diff_error_is_reported_where_float32_cannot_land_on_tuned():
    # base + fl32(tuned - base) misses tuned when |tuned| << |tuned - base|: no float32 diff
    # reaches it (1000 + d lands on multiples of 2^-14 near zero). The report says so.
    base = {"v": torch.tensor([1000.0, 3.0, -7.5, 1.0e-3])}
    tuned = {"v": torch.tensor([1.0e-6, 3.5, 7.5, 2.0])}
    report = shuttle.extract_lora(base, tuned, rank=RANK)
    (row,) = report.rows
    got = base["v"] + report.tensors["v.diff"]
    assert got[1:].equal(tuned["v"][1:]) and not got[0].equal(tuned["v"][0])
    assert row.error == pytest.approx(float((got - tuned["v"]).norm()) / row.delta_norm)
    assert 0 < row.error < 1e-6  # (energy = 1 - error^2 rounds to 1.0 here)


def test_bf16_checkpoint_diffs_exact_and_factors_bf16():
    base, tuned = _checkpoints()
    base = {k: v.bfloat16() for k, v in base.items()}
    tuned = {k: v.bfloat16() for k, v in tuned.items()}
    report = shuttle.extract_lora(base, tuned, rank=RANK)
    assert report.tensors["proj.lora_up.weight"].dtype == torch.bfloat16
    model = Net().bfloat16()
    model.load_state_dict(base, strict=False)
    shuttle.merge_lora(model, [(report.tensors, 1.0)])
    merged = model.state_dict()
    for row in report.rows:
        if row.kind in ("diff", "set", "identical"):
            assert torch.equal(merged[row.name], tuned[row.name]), row.name


def test_dtype_argument_rounds_payloads_and_reports_it():
    base, tuned = _checkpoints()
    report = shuttle.extract_lora(base, tuned, rank=RANK, dtype=torch.float16)
    assert report.tensors["norm.diff"].dtype == torch.float16
    assert report.tensors["gate.set_weight"].dtype == torch.float32  # set values as they are
    row = next(r for r in report.rows if r.name == "pos")
    assert row.error > 0  # an independent tensor's diff is not exact in float16


def test_identical_tensors_are_skipped():
    base, tuned = _checkpoints()
    report = shuttle.extract_lora(base, tuned, rank=RANK)
    same = [r for r in report.rows if r.kind == "identical"]
    assert {r.name for r in same} >= {"same.weight", "same.bias", "mlp.bias"}
    assert all(r.bytes == 0 for r in same)
    assert not any(k.startswith("same.") for k in report.tensors)


def test_repeatable_and_leaves_global_rng_alone(tmp_path):
    base, tuned = _checkpoints()
    state = torch.get_rng_state()
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    shuttle.extract_lora(base, tuned, a, rank=RANK, seed=5)
    shuttle.extract_lora(base, tuned, b, rank=RANK, seed=5)
    assert a.read_bytes() == b.read_bytes()
    assert torch.equal(torch.get_rng_state(), state)


def test_reads_each_tensor_once(tmp_path, monkeypatch):
    base, tuned = _checkpoints()
    bp, tp = _save(base, tmp_path / "b.safetensors"), _save(tuned, tmp_path / "t.safetensors")
    reads: list[tuple[str, str]] = []
    real = SafetensorsFile.read

    def counting(self, key, **kw):
        reads.append((self.path.name, key))
        return real(self, key, **kw)

    monkeypatch.setattr(SafetensorsFile, "read", counting)
    shuttle.extract_lora(bp, tp, tmp_path / "o.safetensors", rank=RANK)
    assert sorted(r for r in reads if r[0] in ("b.safetensors", "t.safetensors")) == sorted(
        [("b.safetensors", k) for k in base] + [("t.safetensors", k) for k in tuned])


# -- inputs: shards, index, directory -------------------------------------------------------------

def _shard(sd: dict[str, torch.Tensor], root, stem: str) -> tuple[list[str], str]:
    names = sorted(sd)
    half = len(names) // 2
    parts = {f"{stem}-00001-of-00002.safetensors": names[:half],
             f"{stem}-00002-of-00002.safetensors": names[half:]}
    root.mkdir()
    for file, keys in parts.items():
        _save({k: sd[k] for k in keys}, root / file)
    index = root / f"{stem}.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {
        k: file for file, keys in parts.items() for k in keys}}))
    return [str(root / f) for f in parts], str(index)


def test_multi_file_index_and_directory_inputs_agree(tmp_path):
    base, tuned = _checkpoints()
    b_files, b_index = _shard(base, tmp_path / "base", "model")
    t_files, t_index = _shard(tuned, tmp_path / "tuned", "model")
    single = shuttle.extract_lora(base, tuned, rank=RANK).tensors
    for b_src, t_src in [(b_files, t_files), (b_index, t_index),
                         (str(tmp_path / "base"), str(tmp_path / "tuned")), (b_index, tuned)]:
        report = shuttle.extract_lora(b_src, t_src, rank=RANK)
        assert report.tensors.keys() == single.keys()
        assert all(torch.equal(report.tensors[k], single[k]) for k in single)


def test_index_naming_a_missing_shard_raises(tmp_path):
    base, tuned = _checkpoints()
    _, index = _shard(base, tmp_path / "base", "model")
    os.remove(tmp_path / "base" / "model-00002-of-00002.safetensors")
    with pytest.raises(AdapterFileError):
        shuttle.extract_lora(index, tuned, tmp_path / "o.safetensors", rank=RANK)
    assert not (tmp_path / "o.safetensors").exists()


# -- bad inputs -----------------------------------------------------------------------------------

def _listing(path) -> list[str]:
    return sorted(os.listdir(path))


def test_shape_mismatch_raises_before_writing(tmp_path):
    base, tuned = _checkpoints()
    tuned["norm.weight"] = torch.randn(65)
    out = tmp_path / "o.safetensors"
    with pytest.raises(ShapeMismatchError, match="norm.weight"):
        shuttle.extract_lora(base, tuned, out, rank=RANK)
    assert _listing(tmp_path) == []


def test_missing_file_raises(tmp_path):
    base, tuned = _checkpoints()
    with pytest.raises(AdapterFileError, match="no such file"):
        shuttle.extract_lora(tmp_path / "nope.safetensors", tuned, tmp_path / "o.safetensors")
    with pytest.raises(AdapterFileError, match="safetensors"):
        shuttle.extract_lora(base, tuned, tmp_path / "o.bin")
    with pytest.raises(AdapterFileError, match="does not exist"):
        shuttle.extract_lora(base, tuned, tmp_path / "missing" / "o.safetensors")
    t = _save(tuned, tmp_path / "t.safetensors")
    with pytest.raises(AdapterFileError, match="input"):
        shuttle.extract_lora(base, t, t)
    assert _listing(tmp_path) == ["t.safetensors"]


@pytest.mark.parametrize("kwargs", [{"rank": 0}, {"rank": 2.5}, {"energy": 0.0},
                                    {"energy": 1.5}, {"rank": 4, "energy": 0.9},
                                    {"dtype": torch.int8}])
def test_bad_arguments(kwargs):
    base, tuned = _checkpoints()
    with pytest.raises(ValueError):
        shuttle.extract_lora(base, tuned, **kwargs)


def test_identical_checkpoints_raise():
    base, _ = _checkpoints()
    with pytest.raises(CheckpointError, match="no parameter differs"):
        shuttle.extract_lora(base, dict(base), rank=RANK)


def test_base_only_reported_or_strict():
    base, tuned = _checkpoints()
    base["old.weight"] = torch.randn(3)
    report = shuttle.extract_lora(base, tuned, rank=RANK)
    assert report.base_only == ["old.weight"]
    with pytest.raises(CheckpointError, match="only in the base"):
        shuttle.extract_lora(base, tuned, rank=RANK, strict=True)


def test_integer_tensors(tmp_path):
    base, tuned = _checkpoints()
    base["ids"] = torch.arange(4)
    tuned["ids"] = torch.arange(4)
    report = shuttle.extract_lora(base, tuned, rank=RANK)
    assert next(r for r in report.rows if r.name == "ids").kind == "identical"
    tuned["ids"] = torch.arange(4) + 1
    report = shuttle.extract_lora(base, tuned, rank=RANK)
    assert "ids" in report.skipped and all(r.name != "ids" for r in report.rows)
    with pytest.raises(CheckpointError, match="float deltas"):
        shuttle.extract_lora(base, tuned, tmp_path / "o.safetensors", rank=RANK, strict=True)
    assert _listing(tmp_path) == []


def test_non_finite_delta_raises(tmp_path):
    base, tuned = _checkpoints()
    tuned["norm.weight"][3] = float("nan")
    with pytest.raises(NonFiniteAdapterError, match="norm.weight"):
        shuttle.extract_lora(base, tuned, tmp_path / "o.safetensors", rank=RANK)
    assert _listing(tmp_path) == []


def test_colliding_names_raise():
    base = {"a.weight": torch.zeros(3), "a": torch.zeros(3)}
    tuned = {"a.weight": torch.ones(3), "a": torch.ones(3)}
    with pytest.raises(CheckpointError, match="both be written"):
        shuttle.extract_lora(base, tuned, rank=RANK)


# -- failures leave an existing output alone ------------------------------------------------------

def test_failure_midway_keeps_existing_output(tmp_path, monkeypatch):
    base, tuned = _checkpoints()
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"previous adapter")
    calls = []
    real = extract_mod._factorize

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(extract_mod, "_factorize", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        shuttle.extract_lora(base, tuned, out, rank=RANK)
    assert out.read_bytes() == b"previous adapter"
    assert _listing(tmp_path) == ["o.safetensors"]  # no temporary file left behind


def test_failed_read_back_keeps_existing_output(tmp_path, monkeypatch):
    base, tuned = _checkpoints()
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"previous adapter")

    def broken(*args, **kwargs):
        raise CheckpointError("simulated read-back failure")

    monkeypatch.setattr(extract_mod, "_check_readback", broken)
    with pytest.raises(CheckpointError, match="simulated"):
        shuttle.extract_lora(base, tuned, out, rank=RANK)
    assert out.read_bytes() == b"previous adapter"
    assert _listing(tmp_path) == ["o.safetensors"]


def test_report_totals_and_json():
    base, tuned = _checkpoints()
    report = shuttle.extract_lora(base, tuned, rank=RANK)
    info = json.loads(json.dumps(report.to_dict()))
    assert info["counts"] == {"lora": 4, "diff": 5, "identical": 6, "set": 2}
    changed = [r for r in report.rows if r.kind in ("lora", "diff")]
    lost = sum((r.error * r.delta_norm) ** 2 for r in changed)
    assert info["energy"] == pytest.approx(1 - lost / sum(r.delta_norm**2 for r in changed))
    assert 0 < info["error"] < 1 and info["bytes"] == report.bytes
