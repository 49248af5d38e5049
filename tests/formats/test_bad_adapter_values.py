"""Adapters and PEFT configs whose values (not their bytes) are wrong get a typed error that names
the key or field and the fix, and the model stays as it was (issue 19, item 11)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import AdapterFormatError

P = "base_model.model."


def _net() -> nn.Module:
    m = nn.Sequential()
    m.first = nn.Linear(8, 6)
    return m


def _merge_refused(sd, match, **load):
    m = _net()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(AdapterFormatError, match=match):
        shuttle.merge_lora(m, [(shuttle.load_lora(sd, **load), 1.0)])
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


@pytest.mark.parametrize("sd", [
    {"first.lora_A.weight": torch.randn(0, 8), "first.lora_B.weight": torch.randn(6, 0)},
    {"lora_unet_first.lora_down.weight": torch.randn(0, 8),
     "lora_unet_first.lora_up.weight": torch.randn(6, 0),
     "lora_unet_first.alpha": torch.tensor(1.0)},
    {"first.hada_w1_a": torch.randn(6, 0), "first.hada_w1_b": torch.randn(0, 8),
     "first.hada_w2_a": torch.randn(6, 0), "first.hada_w2_b": torch.randn(0, 8),
     "first.alpha": torch.tensor(1.0)},
], ids=["peft", "kohya", "loha"])
def test_zero_rank(sd):
    _merge_refused(sd, r"empty factor \(rank 0\).*export it again")


@pytest.mark.parametrize("alpha", [1e308, -1e300])
def test_alpha_whose_scale_leaves_float32(alpha):
    sd = {"lora_unet_first.lora_down.weight": torch.randn(2, 8),
          "lora_unet_first.lora_up.weight": torch.randn(6, 2),
          "lora_unet_first.alpha": torch.tensor(alpha, dtype=torch.float64)}
    _merge_refused(sd, r"alpha .* over rank 2 gives the scale .* beyond float32's range")


@pytest.mark.parametrize(("config", "match"), [
    ([1, 2], "the PEFT config is a list; it must be a JSON object"),
    ("r", "the PEFT config is a str"),
    ({"r": 1e999}, "r is inf; a rank must be a whole number >= 1"),
    ({"r": 0}, "r is 0; a rank"),
    ({"r": 2.5}, "r is 2.5; a rank"),
    ({"r": True}, "r is True; a rank"),
    ({"rank_pattern": ["first"]}, "rank_pattern is a list; it must map"),
    ({"alpha_pattern": "first"}, "alpha_pattern is a str"),
    ({"rank_pattern": {"first": 1e999}}, r"rank_pattern\['first'\] is inf"),
    ({"alpha_pattern": {"first": "inf"}}, r"alpha_pattern\['first'\] is 'inf'"),
    ({"lora_alpha": 1e308}, "lora_alpha is 1e\\+308; alpha must be a finite number within"),
    # a pattern key no linear-time matcher runs (real regexes with groups are accepted)
    ({"rank_pattern": {r"(a)\1b": 2}}, "uses a backreference at index 3"),
])
def test_bad_peft_config(config, match):
    sd = {f"{P}first.lora_A.weight": torch.randn(2, 8),
          f"{P}first.lora_B.weight": torch.randn(6, 2)}
    _merge_refused(sd, match, config=config)
