"""The CuTe DSL's import: an optional dependency whose absence names the extra."""

from __future__ import annotations

import pytest

from shuttle.kernels.cute_dsl import CUTE_TILES, CuteTile, best_tile, dsl


def test_a_missing_dsl_names_the_extra(monkeypatch):
    import sys

    from shuttle.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "cutlass", None)  # import cutlass -> ImportError
    with pytest.raises(MissingDependencyError, match=r"shuttle\[hopper\]"):
        dsl.__wrapped__()


@pytest.mark.parametrize(("t", "n", "shrink", "tile"), [
    # 1536 columns at 4096 rows: 192 tiles of 128 x 256 fill 73% of two rounds of 132 SMs,
    # 256 of 128 x 192 97%; with the shrink's 22 S tiles those spill into a third round
    (4096, 1536, False, (128, 192)), (4096, 1536, True, (128, 256)),
    (4096, 4608, False, (128, 192)), (4096, 4608, True, (128, 192)),
    # full rounds either way: the widest tile costs least per element
    (32760, 1536, False, (128, 256)), (4096, 6144, True, (128, 256)),
    # one column tile: the narrowest wastes least of it
    (4096, 64, False, (128, 128))])
def test_the_tile_is_the_one_whose_rounds_of_units_finish_first(t, n, shrink, tile):
    assert (best_tile(t, n, 132, shrink).m, best_tile(t, n, 132, shrink).n) == tile


def test_pingpong_asks_among_the_pingpong_tiles():
    from shuttle.kernels.cute_dsl import PINGPONG_TILES

    assert best_tile(32760, 1536, 132, pingpong=True) in PINGPONG_TILES
    assert best_tile(32760, 1536, 132) not in PINGPONG_TILES


def test_tiles_compare_by_shape_alone():
    """The cost is a weight for the choice, not part of a compiled program's key."""
    assert CuteTile(128, 192, 64, cost=2.0) == CUTE_TILES[1]
    assert hash(CuteTile(128, 192, 64, cost=2.0)) == hash(CUTE_TILES[1])
