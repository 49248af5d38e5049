"""apply_lora(mode="auto"): merge where the dtype keeps the update, dynamic where rounding eats it;
decisions measured as documented; outputs as the merged / dynamic paths; exact restore."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch import nn

import shuttle
from shuttle.apply.auto import AutoReport, decide
from shuttle.apply.plan import plan_merge
from shuttle.errors import InvalidStrengthError, ShapeMismatchError
from shuttle.hooks import hooks_of
from tests import assert_unchanged, snapshot


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32)).to(dtype)


def _adapter():
    """Layer 0: an update ~1e-4 of the weight (bf16 rounds it away); layer 2: a large one."""
    g = torch.Generator().manual_seed(1)
    return {
        "0.lora_A.weight": torch.randn(4, 64, generator=g) * 1e-2,
        "0.lora_B.weight": torch.randn(64, 4, generator=g) * 1e-3,
        "2.lora_A.weight": torch.randn(4, 64, generator=g) * 0.5,
        "2.lora_B.weight": torch.randn(32, 4, generator=g) * 0.5,
    }


def _assert_restored(model, before):
    assert_unchanged(model, before)
    assert all(not hooks_of(m) for m in model.modules())


def test_small_update_stays_dynamic_large_one_is_merged(caplog):
    m = _model()
    x = torch.randn(3, 64).bfloat16()
    before = snapshot(m)
    with caplog.at_level(logging.INFO, logger="shuttle"), \
            shuttle.apply_lora(m, [(_adapter(), 1.0)], mode="auto") as report:
        assert isinstance(report, AutoReport)
        assert report.decisions == {"0.weight": "dynamic", "2.weight": "merge"}
        assert report.losses["0.weight"] > 0.5 and report.losses["2.weight"] < 0.01
        assert report.merged == ["2.weight"] and report.applied == ["0.weight", "2.weight"]
        assert report.dynamic.applied == ["0.weight"]
        assert torch.equal(m[0].weight, before["0.weight"])  # dynamic: weight untouched
        assert hooks_of(m[0]) and not hooks_of(m[2])
        got, got0 = m(x), m[0](x)
    assert "0.weight -> dynamic" in caplog.text and "2.weight -> merge" in caplog.text
    _assert_restored(m, before)

    # Layer 0 as in mode="dynamic", layer 2 as in mode="merge".
    with shuttle.apply_lora(m, [(_adapter(), 1.0)], mode="dynamic"):
        want0 = m[0](x)
    with shuttle.apply_lora(m, [(_adapter(), 1.0)], mode="merge"):
        merged2 = m[2].weight.detach().clone()
        want = m[2](m[1](want0))
    # The same hook and the same merged weight as those modes: equal, not just close.
    assert torch.equal(got0, want0)
    assert torch.equal(got, want)
    with shuttle.apply_lora(m, [(_adapter(), 1.0)], mode="auto"):
        assert torch.equal(m[2].weight, merged2)  # bit for bit the merge's weight


def test_the_dynamic_part_keeps_the_small_update():
    """What auto is for: in bf16 a merge drops the small update; auto keeps it."""
    m = _model()
    x = torch.randn(8, 64).bfloat16()
    sd = _adapter()
    exact = (x.double() @ m[0].weight.double().T + m[0].bias.double()
             + x.double() @ (sd["0.lora_B.weight"] @ sd["0.lora_A.weight"]).double().T)
    base_err = (m[0](x).double() - exact).abs().mean()
    with shuttle.apply_lora(m, [(sd, 1.0)], mode="auto"):
        auto_err = (m[0](x).double() - exact).abs().mean()
    assert auto_err < base_err


@pytest.mark.parametrize(("threshold", "want"), [
    (0.0, {"0.weight": "dynamic", "2.weight": "dynamic"}),
    (0.05, {"0.weight": "dynamic", "2.weight": "merge"}),
    (100.0, {"0.weight": "merge", "2.weight": "merge"}),
])
def test_threshold(threshold, want):
    m = _model()
    before = snapshot(m)
    with shuttle.apply_lora(m, [(_adapter(), 1.0)], mode="auto",
                            auto_threshold=threshold) as report:
        assert report.decisions == want
        params = dict(m.named_parameters())
        for name, mode in want.items():
            if mode == "dynamic":
                assert torch.equal(params[name], before[name]) and hooks_of(m[int(name[0])])
        assert torch.equal(params["2.weight"], before["2.weight"]) == (want["2.weight"] != "merge")
    _assert_restored(m, before)


def test_float32_weights_lose_nothing_and_are_merged():
    m = _model(torch.float32)
    with shuttle.apply_lora(m, [(_adapter(), 1.0)], mode="auto", auto_threshold=0.0) as report:
        assert report.decisions == {"0.weight": "merge", "2.weight": "merge"}
        assert report.losses == {"0.weight": 0.0, "2.weight": 0.0}


def test_decide_measures_the_fraction_of_the_update_lost():
    m = _model()
    sd = _adapter()
    plan = plan_merge(m, [(sd, 0.7)])
    params = dict(m.named_parameters())
    decisions = decide(plan, params, threshold=0.05)
    for layer in ("0", "2"):
        w = params[f"{layer}.weight"].detach().double()
        up, down = sd[f"{layer}.lora_B.weight"], sd[f"{layer}.lora_A.weight"]
        delta = 0.7 * (up.double() @ down.double())
        merged = (w + delta).to(torch.bfloat16).double()
        want = ((merged - w - delta).norm() / delta.norm()).item()
        assert decisions[f"{layer}.weight"].loss == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("body_raises", [False, True])
def test_exact_restore(body_raises):
    m = _model()
    before = snapshot(m)
    with pytest.raises(RuntimeError) if body_raises else contextlib.nullcontext(), \
            shuttle.apply_lora(m, [(_adapter(), 1.0)], mode="auto", backup_device="cpu"):
        m(torch.randn(2, 64).bfloat16())
        if body_raises:
            raise RuntimeError("body")
    _assert_restored(m, before)


def test_a_failing_merge_detaches_and_restores(monkeypatch):
    import shuttle.apply.scoped as scoped

    m = _model()
    before = snapshot(m)

    def boom(*args, **kwargs):
        raise RuntimeError("merge failed")

    monkeypatch.setattr(scoped, "merge_plan", boom)
    with pytest.raises(RuntimeError, match="merge failed"), \
            shuttle.apply_lora(m, [(_adapter(), 1.0)], mode="auto"):
        pass
    _assert_restored(m, before)


def test_bad_inputs_change_nothing():
    m = _model()
    before = snapshot(m)
    for bad in (float("nan"), -0.1, "0.1", True):
        with pytest.raises(InvalidStrengthError), \
                shuttle.apply_lora(m, [(_adapter(), 1.0)], mode="auto", auto_threshold=bad):
            pass
    sd = _adapter()
    sd["2.lora_B.weight"] = torch.randn(31, 4)
    with pytest.raises(ShapeMismatchError), shuttle.apply_lora(m, [(sd, 1.0)], mode="auto"):
        pass
    _assert_restored(m, before)
