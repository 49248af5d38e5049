"""select_columns: every kind's column window equals the columns of its whole update; kinds
whose update needs whole rows are refused by validation."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import UnsupportedLayerError
from shuttle.patches import IA3, Diff, DoRA, LoHa, LoKr, LowRank, Set
from shuttle.patches.select_columns import ColumnsOf, select_columns

G = torch.Generator().manual_seed(4)


def _r(*shape):
    return torch.randn(*shape, generator=G, dtype=torch.float64)


CASES = {
    "lora": (LowRank("weight", up=_r(6, 2), down=_r(2, 10), scale=0.5), (6, 10)),
    "locon": (LowRank("weight", up=_r(6, 2, 1, 1), down=_r(2, 10, 3, 3), scale=0.5),
              (6, 10, 3, 3)),
    "tucker": (LowRank("weight", up=_r(6, 2, 1, 1), down=_r(2, 10, 1, 1), mid=_r(2, 2, 3, 3)),
               (6, 10, 3, 3)),
    "diff": (Diff("weight", diff=_r(6, 10)), (6, 10)),
    "loha": (LoHa("weight", w1a=_r(6, 2), w1b=_r(2, 10), w2a=_r(6, 2), w2b=_r(2, 10)), (6, 10)),
    "lokr": (LoKr("weight", w1=_r(2, 2), w2=_r(3, 5)), (6, 10)),
}


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("window", [(0, 4), (4, 10), (3, 4)])
def test_the_window_is_the_columns_of_the_whole_update(kind, window):
    patch, shape = CASES[kind]
    cut = select_columns(patch, *window, shape[1])
    local = (shape[0], window[1] - window[0], *shape[2:])
    cut.check(local, "w")
    whole = patch.delta(shape)
    # deltas are float32: another window is another matmul shape, equal within its rounding
    torch.testing.assert_close(cut.delta(local), whole[:, window[0]:window[1]], rtol=1e-6,
                               atol=1e-6)
    if kind in ("lora", "locon", "diff"):  # cut in its own tensors, not wrapped
        assert not isinstance(cut, ColumnsOf)


def test_set_takes_its_value_columns():
    value = _r(6, 10)
    cut = select_columns(Set("weight", value=value), 2, 5, 10)
    w = torch.zeros(6, 3, dtype=torch.float64)
    torch.testing.assert_close(cut.apply(w, 1.0), value[:, 2:5], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("patch", [
    DoRA("weight", magnitude=_r(6), inner=LowRank("weight", up=_r(6, 2), down=_r(2, 10)),
         mode="inner"),
    IA3("weight", weight=_r(10), on_input=True),
], ids=["dora", "ia3"])
def test_kinds_needing_whole_rows_are_refused(patch):
    with pytest.raises(UnsupportedLayerError, match="whole rows"):
        select_columns(patch, 0, 4, 10).check((6, 4), "w")
