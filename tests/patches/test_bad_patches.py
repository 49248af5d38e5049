"""Patches refuse what they cannot apply with a typed error naming the input and the fix, never a
bare IndexError, AssertionError or torch RuntimeError (issue 19, item 11)."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import AdapterFormatError, NonFiniteAdapterError, ShapeMismatchError
from shuttle.patches import IA3, LoHa, LowRank


@pytest.mark.parametrize("on_input", [False, True])
def test_ia3_on_a_1d_parameter(on_input):
    p = IA3("weight", weight=torch.ones(4), on_input=on_input)
    with pytest.raises(ShapeMismatchError, match=r"'norm.weight'.*shape \(4,\).*different model"):
        p.check((4,), "norm.weight")


def test_loha_tucker_needs_both_cores():
    w = torch.randn(2, 4)
    with pytest.raises(AdapterFormatError, match="hada_t1 and hada_t2"):
        LoHa("weight", w1a=w, w1b=w, w2a=w, w2b=w, t1=torch.randn(2, 2, 3, 3))


@pytest.mark.parametrize(("strength", "scale"), [(1e308, 1.0), (1e30, 1e10), (-1e39, 1.0)])
def test_lowrank_strength_times_scale_beyond_float32(strength, scale):
    p = LowRank("weight", up=torch.randn(6, 2), down=torch.randn(2, 8), scale=scale)
    w = torch.zeros(6, 8)
    with pytest.raises(NonFiniteAdapterError, match=r"strength .* times the adapter's scale"):
        p.apply(w, strength)
    assert torch.equal(w, torch.zeros(6, 8))  # refused before the write
