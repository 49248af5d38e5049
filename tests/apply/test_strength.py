"""One strength check for every entry point (issue 19, item 15)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import shuttle
from shuttle.apply.strength import check_strength
from shuttle.errors import AdapterIndexError, InvalidStrengthError


@pytest.mark.parametrize("value", [0.5, 1, np.float32(0.5), np.float64(0.5), np.int64(1),
                                   torch.tensor(0.5), torch.tensor([0.5], dtype=torch.float16)])
def test_accepted(value):
    assert check_strength(value) == pytest.approx(float(value), rel=1e-3)


@pytest.mark.parametrize("value", [True, np.bool_(False), torch.tensor(True), "0.5", None,
                                   float("nan"), float("inf"), 1e308, -1e39,
                                   torch.tensor([0.5, 0.5]), complex(1, 0)])
def test_refused(value):
    with pytest.raises(InvalidStrengthError, match="loras\\[3\\] strength"):
        check_strength(value, "loras[3] strength")


def _handle():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6))
    sd = {"0.lora_A.weight": torch.randn(2, 8, generator=g),
          "0.lora_B.weight": torch.randn(6, 2, generator=g)}
    return model, sd, shuttle.attach_lora(model, [(sd, 1.0)])


def test_set_strength_takes_what_merge_takes():
    model, _, h = _handle()
    x = torch.randn(3, 8)
    h.set_strength(0, np.float32(0.25))
    y = model(x)
    h.set_strength(0, torch.tensor(0.25))  # refused before: a 0-dim tensor
    assert torch.equal(model(x), y)
    for bad in (True, 1e308):
        with pytest.raises(InvalidStrengthError, match=r"set_strength\(0, strength\)"):
            h.set_strength(0, bad)
    assert torch.equal(model(x), y)


def test_attach_refuses_a_strength_float32_cannot_hold():
    model, sd, h = _handle()
    h.detach()
    with pytest.raises(InvalidStrengthError, match="within float32's range"):
        shuttle.attach_lora(model, [(sd, 1e308)])


@pytest.mark.parametrize("index", [1, -2, "0", 0.0, True])
def test_an_index_that_names_no_adapter(index):
    model, sd, h = _handle()
    x = torch.randn(3, 8)
    y = model(x)
    why = ("no adapter of that name" if isinstance(index, str)
           else r"holds 1 adapter\(s\), at indices 0..0")
    with pytest.raises(AdapterIndexError, match=why):
        h.set_strength(index, 0.5)
    with pytest.raises(AdapterIndexError, match=r"swap\("):
        h.swap(index, sd)
    assert torch.equal(model(x), y)
