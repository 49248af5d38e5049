"""One rounding default for every entry point: nearest into 16/32/64-bit floats, stochastic
(seeded by the parameter's name) into float8 and quantized weights."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import shuttle
from shuttle.apply.rounding import check_rounding, rounding_for
from shuttle.errors import InvalidOptionError


def _model_and_lora() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential()
    model.layer = nn.Linear(64, 32, bias=False)
    model.layer.weight.data = torch.randn(32, 64, generator=g).to(torch.float8_e4m3fn)
    model.layer.weight.requires_grad_(False)
    return model, {"layer.lora_A.weight": torch.randn(4, 64, generator=g) * 0.1,
                   "layer.lora_B.weight": torch.randn(32, 4, generator=g) * 0.1}


def test_every_entry_point_rounds_the_same_by_default(tmp_path):
    base, sd = _model_and_lora()
    loras = [(sd, 0.7)]

    merged = copy.deepcopy(base)
    shuttle.merge_lora(merged, loras)
    want = merged.layer.weight

    scoped = copy.deepcopy(base)
    with shuttle.apply_lora(scoped, loras, mode="merge"):
        in_scope = scoped.layer.weight.clone()

    save_file({"layer.weight": base.layer.weight}, tmp_path / "base.safetensors")
    with torch.device("meta"):
        fresh = copy.deepcopy(base).to("meta")
    shuttle.load_checkpoint(fresh, tmp_path / "base.safetensors", loras)

    shuttle.merge_files(tmp_path / "base.safetensors", loras, tmp_path / "out.safetensors")
    in_file = load_file(tmp_path / "out.safetensors")["layer.weight"]

    for got in (in_scope, fresh.layer.weight, in_file):
        assert got.dtype == torch.float8_e4m3fn
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    nearest = copy.deepcopy(base)
    shuttle.merge_lora(nearest, loras, rounding="nearest")
    assert not torch.equal(nearest.layer.weight.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize(("dtype", "rounding"), [
    (torch.bfloat16, "nearest"), (torch.float16, "nearest"), (torch.float32, "nearest"),
    (torch.float64, "nearest"), (torch.float8_e4m3fn, "stochastic"),
    (torch.float8_e5m2, "stochastic"),
])
def test_the_default_follows_the_dtype(dtype, rounding):
    assert rounding_for(None, dtype) == rounding
    assert rounding_for("nearest", dtype) == "nearest"


@pytest.mark.parametrize("bad", ["up", "Nearest", 1, True])
def test_a_bad_rounding_names_the_choices(bad):
    with pytest.raises(InvalidOptionError, match="expected 'nearest', 'stochastic' or None"):
        check_rounding(bad)
