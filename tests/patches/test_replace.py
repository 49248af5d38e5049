"""Replace: a trained copy of a whole parameter, reached by strength as W + m * (value - W)."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import ShapeMismatchError
from shuttle.patches import PATCH_KINDS, Replace


def test_strength_interpolates_from_the_weight_to_the_value():
    w, v = torch.randn(5, 4), torch.randn(5, 4)
    p = Replace("weight", value=v)
    assert PATCH_KINDS["replace"].patch is Replace and not p.additive
    assert torch.equal(p.apply(w.clone(), 1.0), v)  # exactly the saved copy, as PEFT has it
    assert torch.equal(p.apply(w.clone(), 0.0), w)
    for m in (0.3, -0.5, 1.7):
        torch.testing.assert_close(p.apply(w.clone(), m).double(),
                                   w.double() + m * (v.double() - w.double()))


def test_a_half_precision_value_lands_exactly_in_a_float32_weight_view():
    v = torch.randn(3, 2).bfloat16()
    out = Replace("bias", value=v).apply(torch.randn(3, 2), 1.0)
    assert torch.equal(out.bfloat16(), v) and out.dtype == torch.float32


def test_shape_is_checked_exactly():
    p = Replace("weight", value=torch.zeros(5, 4))
    p.check((5, 4), "head.weight")
    with pytest.raises(ShapeMismatchError, match="trained copy of the whole parameter"):
        p.check((4, 5), "head.weight")
