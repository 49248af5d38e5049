"""The CuTe LoRA GEMM's work units: the order that lets output tiles wait on S tiles safely."""

from __future__ import annotations

import pytest
import torch

from shuttle.kernels.lora_gemm_units import (
    L2_AHEAD_BYTES,
    S_UNIT,
    UNIT_FIELD,
    s_blocks_of,
    s_tiles_ahead,
    s_tiles_of,
    shrink_work_list,
)


def test_the_shrink_work_list_puts_each_s_tile_before_its_readers():
    """Each output tile once; each S tile once, ``ahead`` S tiles before the first output tile
    of its rows (or at the start), never after one: a CTA waiting on an S tile waits on a unit
    taken earlier. With S tiles of 192 tokens over row tiles of 128, a row tile straddling two
    S tiles comes after both."""
    for m_blocks, tiles_n, tile_m, tile_n, ahead in [
            (7, 3, 128, 256, 2), (256, 6, 128, 256, 11), (1, 1, 128, 128, 1), (5, 2, 128, 128, 9),
            (34, 15, 128, 256, 5), (32, 8, 128, 192, 3), (7, 2, 128, 192, 1), (1, 1, 128, 192, 1),
            (3, 1, 128, 192, 2), (256, 8, 128, 192, 12)]:
        codes = shrink_work_list(m_blocks, tiles_n, tile_m, tile_n, ahead)
        s_at = {c - S_UNIT: i for i, c in enumerate(codes) if c >= S_UNIT}
        tiles = [(i, divmod(c, UNIT_FIELD)) for i, c in enumerate(codes) if c < S_UNIT]
        s_blocks = s_blocks_of(m_blocks, tile_m, tile_n)
        assert s_blocks * tile_n >= m_blocks * tile_m > (s_blocks - 1) * tile_n
        assert sorted(s_at) == list(range(s_blocks))
        assert sorted(mn for _, mn in tiles) == [(m, n) for m in range(m_blocks)
                                                 for n in range(tiles_n)]
        first_reader = {}
        for i, (m, _) in tiles:
            reads = s_tiles_of(m, tile_m, tile_n)
            # the S tiles whose tokens the row tile's rows are
            assert reads[0] * tile_n <= m * tile_m and (m + 1) * tile_m <= (reads[-1] + 1) * tile_n
            for j in reads:
                first_reader.setdefault(j, i)
        for j, at in s_at.items():
            assert at < first_reader[j]
            # ahead S tiles' readers come between it and its own first reader
            between = {j2 for i, (m, _) in tiles if at < i < first_reader[j]
                       for j2 in s_tiles_of(m, tile_m, tile_n)}
            assert len(between) <= ahead
        assert codes[:min(ahead, s_blocks)] == [S_UNIT + j for j in range(min(ahead,
                                                                               s_blocks))]
    with pytest.raises(ValueError, match="fields"):
        shrink_work_list(UNIT_FIELD, 1, 128, 256, 1)


@pytest.mark.parametrize(("readers", "x_bytes"), [(12, 786432), (112, 2 << 20), (30, 1966080),
                                                  (70, 786432), (1, 1)])
@pytest.mark.parametrize("tile_n", [256, 192])
def test_an_s_tile_is_placed_a_round_and_a_quarter_before_its_first_reader(readers, x_bytes,
                                                                          tile_n):
    """Where L2 can hold the rows of x the S tiles read meanwhile, at least 1.25 rounds of the
    SMs' units separate an S tile from its first reader (else its readers, running in its
    round, wait for it); never more x than L2_AHEAD_BYTES read ahead."""
    sms, tile_m = 132, 128
    tiles_n = max(1, readers // 2)
    ahead = s_tiles_ahead(sms, tiles_n * tile_n / tile_m, x_bytes)
    m_blocks = -(-(ahead + 8) * tile_n // tile_m)
    codes = shrink_work_list(m_blocks, tiles_n, tile_m, tile_n, ahead)
    at = {c - S_UNIT: i for i, c in enumerate(codes) if c >= S_UNIT}
    first = {}
    for i, c in enumerate(codes):
        if c < S_UNIT:
            for j in s_tiles_of(c // UNIT_FIELD, tile_m, tile_n):
                first.setdefault(j, i)
    gaps = [first[j] - at[j] for j in at if j >= ahead]  # past the prelude
    assert (ahead - 1) * x_bytes <= L2_AHEAD_BYTES or ahead == 1
    if (ahead + 1) * x_bytes <= L2_AHEAD_BYTES:  # L2 did not limit it
        assert min(gaps) >= 1.25 * sms


def test_work_lists_are_made_once_kept_to_a_capacity_and_never_made_in_a_capture():
    """One list per (rows, shape), shared; the least recently used dropped past the capacity,
    except lists a capture used (a replay reads them); none made while capturing; one flags
    buffer, zero, sized for the longest list."""
    from shuttle.kernels.lora_gemm_units import WorkLists

    lists = WorkLists(torch.device("cpu"), capacity=2)
    a = lists.get(10, 3, 128, 256, 2)
    assert lists.get(10, 3, 128, 256, 2) is a and len(lists) == 1
    table, units, s_blocks = a
    assert table.tolist() == shrink_work_list(10, 3, 128, 256, 2) and units == 10 * 3 + 5
    assert s_blocks == 5
    assert lists.flags.shape == (2 * UNIT_FIELD,) and not lists.flags.any()
    flags = lists.flags
    assert lists.get(11, 3, 128, 256, 2, capturing=True) is None and len(lists) == 1  # none made
    assert lists.get(10, 3, 128, 256, 2, capturing=True) is a  # used by a capture: kept
    lists.get(12, 3, 128, 256, 2)
    lists.get(13, 3, 128, 256, 2)
    lists.get(14, 3, 128, 256, 2)  # evicts 12: capacity 2 besides the captured
    assert len(lists) == 3 and lists.get(10, 3, 128, 256, 2, capturing=True) is a
    assert lists.get(12, 3, 128, 256, 2, capturing=True) is None
    assert lists.flags is flags  # one buffer for every list
