"""Budgets as users write them: integers, floats, and numbers with a unit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shuttle.byte_count import UNITS, byte_count
from shuttle.errors import CacheError, OffloadError


@pytest.mark.parametrize(("value", "count"), [
    (6 * 2**30, 6 * 2**30), (0, 0), (np.int64(512), 512),
    (6e9, 6_000_000_000), (4.5 * 2**30, 4_831_838_208), (1023.9, 1023),
    ("6GiB", 6 * 2**30), ("6 gb", 6_000_000_000), (" 1.5GiB ", 3 * 2**29),
    (".5MiB", 2**19), ("2e3KB", 2_000_000), ("100", 100), ("7 TiB", 7 * 2**40),
])
def test_spellings_read_as_whole_bytes(value, count):
    got = byte_count(value, "vram_budget", OffloadError)
    assert got == count and type(got) is int


@pytest.mark.parametrize("value", [True, False, -1, -0.5, math.nan, math.inf, 2**63, 1e19,
                                   "-5GB", "", "GiB", "6 G", "6 GiBs", "6,5GB", "1e400",
                                   "1e1000000000GiB", "8388608TiB", None, [1], b"6GB"])
def test_what_is_not_a_byte_count_is_refused_naming_the_spellings(value):
    with pytest.raises(CacheError, match=r"max_bytes=.*expected a number of bytes from 0.*'6GiB'"):
        byte_count(value, "max_bytes", CacheError)


@settings(derandomize=True, database=None, deadline=None)
@given(st.integers(0, 2**22), st.sampled_from(sorted(UNITS)))  # at most 2**62 bytes
def test_a_whole_number_with_any_unit_in_any_case_is_that_many_units(n, unit):
    for spelled in (f"{n}{unit}", f"{n} {unit.upper()}", f"{n}{unit.title()}"):
        assert byte_count(spelled, "b", OffloadError) == n * UNITS[unit]
