"""Promises of issue 19 that the merge entry points keep.

- ``strict=True`` on every entry point: an adapter key that lands nowhere is an
  ``UnmatchedKeysError`` before any change; by default an adapter of which nothing lands warns.
- Float64 adapters work in merge, scoped and dynamic use, load and file merges, computed in
  float64 (checked against float64 math).
- ``merge_lora`` rolls back the parameters it merged when a later one overflows float16.
- A file merge reports a NaN adapter as such, and an overflow without claims that are false
  there; it checks each merged tensor once and copies untouched ones without a check.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import shuttle
from shuttle.apply import merge as merge_mod
from shuttle.apply import merge_files as merge_files_mod
from shuttle.errors import NonFiniteAdapterError, UnmatchedKeysError
from tests import assert_unchanged, snapshot


def _model(dtype: torch.dtype = torch.float32, n: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(n))
    return model.to(dtype)


def _lora(layers: list[int], *, dtype: torch.dtype = torch.float32, scale: float = 0.1,
          prefix: str = "layers", seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in layers:
        out[f"{prefix}.{i}.lora_A.weight"] = (torch.randn(2, 8, generator=g) * scale).to(dtype)
        out[f"{prefix}.{i}.lora_B.weight"] = (torch.randn(8, 2, generator=g) * scale).to(dtype)
    return out


# -- strict, and the loud warning when nothing lands (item 9) ---------------------------------

def test_merge_strict_refuses_unmatched_keys_before_any_change():
    model = _model()
    before = snapshot(model)
    sd = {**_lora([0, 1]), **_lora([5], prefix="elsewhere", seed=2)}
    with pytest.raises(UnmatchedKeysError, match="elsewhere.5") as info:
        shuttle.merge_lora(model, [(sd, 1.0)], strict=True)
    assert list(info.value.unmatched) == ["elsewhere.5"]
    assert "no module" in info.value.unmatched["elsewhere.5"]
    assert isinstance(info.value, shuttle.errors.ShuttleError)
    assert_unchanged(model, before)
    # without strict: the matching keys land and the other is reported
    report = shuttle.merge_lora(model, [(sd, 1.0)])
    assert report.applied == ["layers.0.weight", "layers.1.weight"]
    assert list(report.unmatched) == ["elsewhere.5"]


def test_a_merge_that_lands_nothing_warns_loudly(caplog):
    model = _model()
    before = snapshot(model)
    with caplog.at_level(logging.WARNING, logger="shuttle"), \
            pytest.warns(UserWarning, match="NO adapter update landed"):
        report = shuttle.merge_lora(model, [(_lora([0], prefix="other_model"), 1.0)])
    assert report.applied == []
    assert any("NO adapter update landed" in r.getMessage() for r in caplog.records)
    assert_unchanged(model, before)


def test_no_warning_without_adapters_or_at_strength_zero(recwarn):
    model = _model()
    shuttle.merge_lora(model, [])
    shuttle.merge_lora(model, [(_lora([0], prefix="other_model"), 0.0)])
    assert not [w for w in recwarn if "landed" in str(w.message)]


@pytest.mark.parametrize("mode", ["merge", "dynamic", "auto"])
def test_apply_lora_strict(mode):
    model = _model()
    before = snapshot(model)
    x = torch.randn(2, 8)
    y0 = model.layers[0](x)
    sd = {**_lora([0]), **_lora([7], prefix="elsewhere")}
    with pytest.raises(UnmatchedKeysError, match="elsewhere.7"), \
            shuttle.apply_lora(model, [(sd, 1.0)], mode=mode, strict=True):
        pytest.fail("the body must not run")
    assert_unchanged(model, before)
    assert torch.equal(model.layers[0](x), y0)  # no hook left behind
    with pytest.warns(UserWarning, match="NO adapter update landed"), \
            shuttle.apply_lora(model, [(_lora([0], prefix="elsewhere"), 1.0)], mode=mode):
        pass


def test_load_checkpoint_strict_adapters(tmp_path):
    src = _model(seed=3)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    model = _model(seed=4)
    before = snapshot(model)
    sd = {**_lora([0]), **_lora([9], prefix="elsewhere")}
    with pytest.raises(UnmatchedKeysError, match="elsewhere.9"):
        shuttle.load_checkpoint(model, path, loras=[(sd, 1.0)], strict_adapters=True)
    assert_unchanged(model, before)  # not even the checkpoint was loaded
    with pytest.warns(UserWarning, match="NO adapter update landed"):
        report = shuttle.load_checkpoint(model, path, loras=[(_lora([0], prefix="x"), 1.0)])
    assert report.patched == []


def test_merge_files_strict_and_allow_empty(tmp_path):
    base = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in _model().state_dict().items()}, str(base))
    out = tmp_path / "out.safetensors"
    sd = {**_lora([0]), **_lora([9], prefix="elsewhere")}
    with pytest.raises(UnmatchedKeysError, match="elsewhere.9"):
        shuttle.merge_files(base, [(sd, 1.0)], out, strict=True)
    with pytest.raises(UnmatchedKeysError, match="Nothing was written"):
        shuttle.merge_files(base, [(_lora([0], prefix="x"), 1.0)], out, allow_empty=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.safetensors"]
    with pytest.warns(UserWarning, match="NO adapter update landed"):
        report = shuttle.merge_files(base, [(_lora([0], prefix="x"), 1.0)], out)
    assert report.applied == [] and out.exists()


# -- float64 adapters (item 10) ---------------------------------------------------------------

def _f64_case(dtype: torch.dtype):
    model = _model(dtype, n=2, seed=5)
    sd = _lora([0, 1], dtype=torch.float64, scale=0.3, seed=6)
    w0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    strength = 0.7
    ref = {f"layers.{i}.weight": w0[f"layers.{i}.weight"] + strength
           * (sd[f"layers.{i}.lora_B.weight"] @ sd[f"layers.{i}.lora_A.weight"])
           for i in range(2)}
    return model, sd, strength, ref


def _close_to_f64(actual: torch.Tensor, ref: torch.Tensor) -> None:
    """``actual`` is ``ref`` (float64 math) rounded once to its dtype: within half an ulp."""
    if actual.dtype == torch.float64:
        torch.testing.assert_close(actual, ref, rtol=1e-15, atol=1e-15)
        return
    half_ulp = torch.finfo(actual.dtype).eps / 2 * ref.abs() * (1 + 1e-9)
    assert bool(((actual.double() - ref).abs() <= half_ulp + 1e-300).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_float64_adapter_merge_lora(dtype):
    model, sd, strength, ref = _f64_case(dtype)
    shuttle.merge_lora(model, [(sd, strength)])
    for n, p in model.named_parameters():
        _close_to_f64(p.detach(), ref[n])


def test_float64_adapter_is_computed_in_float64():
    """A float32 weight: the float64 update is summed in float64 and rounded once, so the
    result is ref rounded to nearest exactly (float32 math would be off by an ulp here)."""
    model, sd, strength, ref = _f64_case(torch.float32)
    shuttle.merge_lora(model, [(sd, strength)])
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), ref[n].float()), n


@pytest.mark.parametrize("mode", ["merge", "auto", "dynamic"])
def test_float64_adapter_apply_lora(mode):
    model, sd, strength, ref = _f64_case(torch.float32)
    before = snapshot(model)
    x = torch.randn(3, 8, dtype=torch.float64)
    with shuttle.apply_lora(model, [(sd, strength)], mode=mode):
        if mode != "dynamic":
            for n, p in model.named_parameters():
                _close_to_f64(p.detach(), ref[n])
        y = model.layers[0](x.float()).double()
        torch.testing.assert_close(y, x @ ref["layers.0.weight"].T, rtol=1e-5, atol=1e-6)
    assert_unchanged(model, before)


def test_float64_adapter_load_checkpoint_and_merge_files(tmp_path):
    model, sd, strength, ref = _f64_case(torch.float32)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    fresh = _model(torch.float32, n=2, seed=99)
    shuttle.load_checkpoint(fresh, path, loras=[(sd, strength)])
    for n, p in fresh.named_parameters():
        _close_to_f64(p.detach(), ref[n])
    shuttle.merge_files(path, [(sd, strength)], tmp_path / "out.safetensors")
    got = load_file(str(tmp_path / "out.safetensors"))
    for n in ref:
        _close_to_f64(got[n], ref[n])


# -- rollback when a later parameter overflows (item 14) --------------------------------------

def _overflow_case(all_risky: bool):
    """float16, three targets; only the third overflows (its weights sit near 65504)."""
    model = _model(torch.float16, n=3, seed=7)
    with torch.no_grad():
        model.layers[2].weight.fill_(65000.0)
    scale = 30.0 if all_risky else 0.1  # factors of 30 bound the update far past 16
    sd = _lora([0, 1], scale=scale, seed=8)
    sd["layers.2.lora_A.weight"] = torch.full((2, 8), 30.0)
    sd["layers.2.lora_B.weight"] = torch.full((8, 2), 30.0)
    return model, sd


@pytest.mark.parametrize("all_risky", [True, False], ids=["all-risky", "third-risky"])
def test_overflow_of_the_third_target_leaves_every_parameter_as_it_was(all_risky, monkeypatch):
    model, sd = _overflow_case(all_risky)
    before = snapshot(model)
    backed_up = []
    real = merge_mod.copy_param
    monkeypatch.setattr(merge_mod, "copy_param",
                        lambda p: backed_up.append(p.shape) or real(p))
    with pytest.raises(NonFiniteAdapterError, match=r"'layers\.2\.weight'") as info:
        shuttle.merge_lora(model, [(sd, 1.0)])
    assert "Nothing was changed" in str(info.value)
    assert "keep their merge" not in str(info.value)
    assert_unchanged(model, before)
    assert len(backed_up) == (3 if all_risky else 1)  # copies only where an overflow can be


def test_no_copy_where_no_update_can_overflow(monkeypatch):
    model = _model(torch.float16, n=3)
    calls = []
    monkeypatch.setattr(merge_mod, "copy_param", lambda p: calls.append(p) or p.clone())
    isfinite = torch.isfinite
    scans = []
    monkeypatch.setattr(torch, "isfinite", lambda t: scans.append(t.shape) or isfinite(t))
    report = shuttle.merge_lora(model, [(_lora([0, 1, 2]), 1.0)])
    assert len(report.applied) == 3
    assert calls == [] and scans == []  # no copy, and no scan of the merged weights


# -- file merges: truthful errors, one check per merged tensor (items 13, 16) -----------------

def test_file_merge_reports_a_nan_adapter_as_such(tmp_path):
    base = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in _model(torch.float16).state_dict().items()},
              str(base))
    sd = _lora([0, 1])
    sd["layers.1.lora_A.weight"][0, 0] = float("nan")
    with pytest.raises(NonFiniteAdapterError, match="holds NaN or infinity") as info:
        shuttle.merge_files(base, [(sd, 1.0)], tmp_path / "out.safetensors")
    text = str(info.value)
    assert "layers.1" in text and "lower the strength" not in text and "keep" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.safetensors"]


def test_file_merge_overflow_message_is_true_there(tmp_path):
    model, sd = _overflow_case(all_risky=False)
    base = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(base))
    with pytest.raises(NonFiniteAdapterError, match="beyond the range") as info:
        shuttle.merge_files(base, [(sd, 1.0)], tmp_path / "out.safetensors")
    text = str(info.value)
    assert "Nothing was written" in text and "keep their merge" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.safetensors"]


@pytest.mark.parametrize(("dtype", "checks"), [(None, 2), ("fp32", 2), ("fp16", 4)])
def test_file_merge_checks_each_tensor_at_most_once(tmp_path, monkeypatch, dtype, checks):
    """Two merged tensors, two untouched: one check per merged tensor; untouched ones are
    copied (or widened to fp32) unchecked, and narrowed to fp16 checked once."""
    base = tmp_path / "base.safetensors"
    save_file({f"layers.{i}.weight": torch.randn(8, 8).bfloat16() for i in range(4)}, str(base))
    calls = []
    real = merge_files_mod._check_range
    monkeypatch.setattr(merge_files_mod, "_check_range",
                        lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    isfinite = torch.isfinite
    scans = []
    monkeypatch.setattr(torch, "isfinite", lambda t: scans.append(t.shape) or isfinite(t))
    report = shuttle.merge_files(base, [(_lora([0, 2]), 1.0)], tmp_path / "o.safetensors",
                                 dtype=dtype)
    assert report.applied == ["layers.0.weight", "layers.2.weight"]
    assert len(calls) == checks
    assert scans == []  # the checks are one aminmax each; isfinite only to say where
