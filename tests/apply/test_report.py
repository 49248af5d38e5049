"""Every adapter application reports applied / unmatched / skipped / notes under those names."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import shuttle
from shuttle import AdapterReport


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def _lora() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"0.lora_A.weight": torch.randn(2, 8, generator=g),
            "0.lora_B.weight": torch.randn(16, 2, generator=g),
            "nowhere.lora_A.weight": torch.randn(2, 8, generator=g),
            "nowhere.lora_B.weight": torch.randn(16, 2, generator=g)}


def _check(report: object) -> None:
    assert isinstance(report, AdapterReport)
    assert list(report.applied) == ["0.weight"]
    assert list(report.unmatched) == ["nowhere"]
    assert report.skipped == {} and report.notes == []


@pytest.mark.parametrize("mode", ["merge", "dynamic", "auto"])
def test_apply_lora_yields_a_report_in_every_mode(mode):
    with shuttle.apply_lora(_model(), [(_lora(), 1.0)], mode=mode) as report:
        _check(report)


def test_merge_attach_load_and_files_report_alike(tmp_path):
    _check(shuttle.merge_lora(_model(), [(_lora(), 1.0)]))
    handle = shuttle.attach_lora(_model(), [(_lora(), 1.0)])
    _check(handle)
    handle.detach()
    model = _model()
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    _check(shuttle.load_checkpoint(model, tmp_path / "model.safetensors", [(_lora(), 1.0)]))
    report = shuttle.merge_files(tmp_path / "model.safetensors", [(_lora(), 1.0)],
                                 tmp_path / "out.safetensors")
    assert set(load_file(tmp_path / "out.safetensors")) == set(model.state_dict())
    _check(report)
