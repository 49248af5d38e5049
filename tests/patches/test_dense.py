"""Dense payloads: additive Diff and replacing Set, against float64 math."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import ShapeMismatchError
from shuttle.patches import Diff, Set
from tests import close


@pytest.mark.parametrize("shape", [(5,), (4, 3), (2, 3, 3, 3)], ids=["bias", "linear", "conv"])
def test_diff(shape):
    diff = torch.randn(shape)
    p = Diff("weight" if len(shape) > 1 else "bias", diff=diff, scale=0.5)
    close(p.delta(shape), 0.5 * diff.double())
    w = torch.randn(shape)
    close(p.apply(w.clone(), 1.5), w.double() + 0.75 * diff.double())
    assert p.out_rows == shape[0]
    p.check(shape, "m.weight")
    assert p.additive


def test_diff_default_scale_and_half_payload():
    diff = torch.randn(3, 4).half()
    p = Diff("weight", diff=diff)
    assert p.scale == 1.0
    w = torch.randn(3, 4)
    close(p.apply(w.clone(), -2.0), w.double() - 2.0 * diff.double())
    assert p.nbytes == 24 and p.shapes() == {"diff": (3, 4)}


def test_diff_scalar_param():
    p = Diff("logit_scale", diff=torch.tensor(0.25))
    assert p.out_rows is None
    close(p.apply(torch.tensor(1.0), 2.0), torch.tensor(1.5, dtype=torch.float64))


def test_diff_check_mismatch():
    p = Diff("weight", diff=torch.randn(4, 3))
    with pytest.raises(ShapeMismatchError, match="diff patch for 'm.weight'"):
        p.check((3, 4), "m.weight")  # same numel: dense payloads must match exactly
    with pytest.raises(ShapeMismatchError, match="must match exactly"):
        p.check((4, 3, 1, 1), "m.weight")


@pytest.mark.parametrize("strength", [1.0, 0.5, -1.0])
def test_set(strength):
    value = torch.randn(6)
    p = Set("scale", value=value)
    w = torch.randn(6)
    out = p.apply(w.clone(), strength)
    close(out, strength * value.double(), rtol=1e-6, atol=1e-6)  # the old value is gone
    close(p.delta((6,)), value.double())
    assert not p.additive and p.param == "scale" and p.out_rows == 6
    with pytest.raises(ShapeMismatchError, match="set patch for 'n.scale'"):
        p.check((5,), "n.scale")


def test_set_weight_2d():
    value = torch.randn(3, 2).bfloat16()
    p = Set("weight", value=value)
    p.check((3, 2), "m.weight")
    close(p.apply(torch.zeros(3, 2), 0.25), 0.25 * value.double())
