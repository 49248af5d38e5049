"""(IA)3: W' = W * (1 + k * w) per output row or input column, against float64 math."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import ShapeMismatchError
from shuttle.patches import IA3
from tests import close


@pytest.mark.parametrize("strength", [1.0, 0.4, -2.0])
def test_output_rows_linear(strength):
    w, s = torch.randn(5, 3), torch.randn(5)
    p = IA3("weight", weight=s)
    expected = w.double() * (1 + strength * s.double())[:, None]
    close(p.apply(w.clone(), strength), expected)


@pytest.mark.parametrize("strength", [1.0, 0.4])
def test_input_columns_linear(strength):
    w, s = torch.randn(5, 3), torch.randn(1, 3)  # LyCORIS stores (1, in)
    p = IA3("weight", weight=s, on_input=True)
    expected = w.double() * (1 + strength * s.double().reshape(-1))[None, :]
    close(p.apply(w.clone(), strength), expected)


def test_conv_rows_and_columns():
    w = torch.randn(4, 3, 3, 3)
    rows, cols = torch.randn(4, 1, 1, 1), torch.randn(3)
    close(IA3("weight", weight=rows).apply(w.clone(), 0.5),
          w.double() * (1 + 0.5 * rows.double().reshape(4, 1, 1, 1)))
    close(IA3("weight", weight=cols, on_input=True).apply(w.clone(), 0.5),
          w.double() * (1 + 0.5 * cols.double().reshape(1, 3, 1, 1)))


def test_check():
    p = IA3("weight", weight=torch.randn(5))
    p.check((5, 3), "m.weight")
    with pytest.raises(ShapeMismatchError, match="5 scales .* 3 output rows"):
        p.check((3, 5), "m.weight")
    with pytest.raises(ShapeMismatchError, match="m.weight"):
        p.check((5,), "m.weight")  # a 1-D parameter has no rows to scale
    q = IA3("weight", weight=torch.randn(3), on_input=True)
    q.check((5, 3), "m.weight")
    with pytest.raises(ShapeMismatchError, match="input columns"):
        q.check((3, 5), "m.weight")


def test_not_additive_and_no_delta():
    p = IA3("weight", weight=torch.randn(4))
    assert not p.additive and p.kind == "ia3"
    with pytest.raises(TypeError, match="apply"):
        p.delta((4, 2))
    assert p.shapes() == {"weight": (4,)} and p.nbytes == 16
