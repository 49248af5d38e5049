"""Per-expert low-rank patches (PEFT ``target_parameters``): the update of each expert against a
loop over experts, both storage layouts, and the placement of factors that name only their
module on one of its parameters.
"""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import ShapeMismatchError, UnsupportedFormatError
from shuttle.patches import PATCH_KINDS, ExpertsLowRank
from shuttle.patches.experts import Choice
from shuttle.patches.kind import spell_patch
from tests import close

E, R, OUT, IN = 3, 2, 5, 4
ONE = (Choice("w", R, 0.5, 1.0),)


def _patch(choices=ONE, depth=0, out=OUT, inp=IN, e=E, r=R):
    g = torch.Generator().manual_seed(0)
    return ExpertsLowRank("|".join(c.param for c in choices),
                          up=torch.randn(out, e * r, generator=g),
                          down=torch.randn(e * r, inp, generator=g),
                          choices=tuple(choices), depth=depth)


def _place(patch, params, transposed=False, ordered=True):
    return PATCH_KINDS["experts_lora"].place(patch, params, transposed, ordered)


@pytest.mark.parametrize("transposed", [False, True])
def test_each_expert_gets_its_own_rows_of_down_and_columns_of_up(transposed):
    """Expert e's factors are ``down[e*r:(e+1)*r]`` and the columns ``e, e+E, ...`` of up."""
    shape = (E, IN, OUT) if transposed else (E, OUT, IN)
    p = _place(_patch(), {"w": shape}, transposed)
    got = p.delta(shape)
    for e in range(E):
        want = 0.5 * p.up[:, e::E] @ p.down[e * R:(e + 1) * R]
        close(got[e], want.T if transposed else want, rtol=1e-6, atol=1e-6)
    w = torch.randn(shape)
    close(p.apply(w.clone(), 0.7), w + 0.7 * got)


def test_a_two_d_parameter_is_one_expert():
    p = _place(_patch(e=1), {"w": (OUT, IN)})
    close(p.delta((OUT, IN)), 0.5 * p.up @ p.down)


def test_placed_on_the_parameter_whose_shape_and_rank_fit():
    """The rank of each choice (PEFT's rank_pattern per parameter) tells E = rows / rank."""
    choices = (Choice("gate_up", 4, 1.0, 4.0), Choice("down", R, 0.5, 1.0))
    params = {"gate_up": (E, 2 * IN, OUT), "down": (E, OUT, IN)}
    p = _place(_patch(choices), params)
    assert (p.param, p.rank, p.scale, p.transposed) == ("down", R, 0.5, False)
    p.check(params["down"], "down")
    with pytest.raises(ShapeMismatchError, match="experts"):
        p.check((E + 1, OUT, IN), "down")


def test_parameters_of_one_shape_are_told_apart_by_peft_nesting():
    """PEFT wraps a module's matching parameters in registration order, the first innermost:
    the outermost wrapper (depth 0) adapts the last one."""
    choices = (Choice("gate", R, 0.5, 1.0), Choice("up", R, 0.5, 1.0))
    params = {"gate": (E, OUT, IN), "up": (E, OUT, IN), "other": (OUT,)}
    assert _place(_patch(choices, depth=0), params).param == "up"
    assert _place(_patch(choices, depth=1), params).param == "gate"
    why = _place(_patch(choices), params, transposed=None, ordered=False)
    assert isinstance(why, str) and "registration order" in why


def test_a_square_tensor_needs_the_modules_layout():
    p = _patch(out=IN, inp=IN)
    assert _place(p, {"w": (E, IN, IN)}, transposed=True).transposed
    assert not _place(p, {"w": (E, IN, IN)}, transposed=False).transposed
    why = _place(p, {"w": (E, IN, IN)}, transposed=None, ordered=False)
    assert isinstance(why, str) and "is_transposed" in why
    # not square: the shapes tell the layout
    assert _place(_patch(), {"w": (E, IN, OUT)}, transposed=None, ordered=False).transposed


def test_factors_that_fit_nothing_say_so():
    why = _place(_patch(), {"w": (E + 1, OUT, IN)})
    assert isinstance(why, str) and "fit none" in why
    with pytest.raises(ShapeMismatchError, match="not placed"):
        _patch((Choice("a", R, 1.0, 1.0), Choice("b", R, 1.0, 1.0))).delta((E, OUT, IN))


@pytest.mark.parametrize("to", ["kohya", "comfy"])
def test_no_file_format_spells_it(to):
    with pytest.raises(UnsupportedFormatError, match="adapter_config.json"):
        spell_patch("m", _place(_patch(), {"w": (E, OUT, IN)}), to)
