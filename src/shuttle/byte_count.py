"""Byte counts as users write them: ``6 * 2**30``, ``6e9``, ``"6GiB"``, ``"512 MB"``.

Every budget shuttle takes (``vram_budget``, ``max_host_bytes``, a cache's ``max_bytes``)
goes through :func:`byte_count`, so each accepts the same spellings and refuses the same
mistakes with the same message. Decimal units are powers of 1000 and binary ones powers of
1024, as in accelerate's ``max_memory`` strings: ``"8GB"`` is 8e9 bytes, ``"8GiB"`` 2**33.
"""

from __future__ import annotations

import decimal
import math
import numbers
import re
import sys

from shuttle.errors import ShuttleError

__all__ = ["UNITS", "ByteCount", "byte_count"]

ByteCount = int | float | str  # what a budget argument takes

UNITS = {"": 1, "b": 1,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

_SPELLED = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([a-z]*)\s*", re.IGNORECASE)


def _whole(number: str, scale: int) -> int | None:
    """floor(number * scale) in exact decimal arithmetic; None above ``sys.maxsize``."""
    try:
        with decimal.localcontext(decimal.Context(prec=64, traps=[decimal.Overflow])):
            size = decimal.Decimal(number) * scale
    except decimal.Overflow:
        return None
    return math.floor(size) if size <= sys.maxsize else None


def byte_count(value: object, name: str, error: type[ShuttleError]) -> int:
    """``value`` as a whole number of bytes (a fraction of a byte rounded down).

    Args:
        value: an integer; a finite ``float`` (``6e9``, ``4.5 * 2**30``); or a string, a
            number and an optional unit (``"6GiB"``, ``"1.5 GB"``, ``"512mib"``; no unit:
            bytes).
        name: the argument's name, for the message.
        error: the error class to raise (the caller's: ``OffloadError``, ``CacheError``).

    Raises:
        error: a bool, a negative, NaN, infinite or larger than ``sys.maxsize`` number, an
            unknown unit, or anything else.
    """
    if isinstance(value, bool):
        count = None
    elif isinstance(value, numbers.Integral):  # int, numpy's integers
        count = int(value)
    elif isinstance(value, float):
        count = math.floor(value) if math.isfinite(value) and value <= sys.maxsize else None
    elif isinstance(value, str) and (m := _SPELLED.fullmatch(value)) is not None:
        number, exponent, unit = m.groups()
        scale = UNITS.get(unit.lower())
        count = None if scale is None else _whole(f"{number}e{exponent or 0}", scale)
    else:
        count = None
    if count is None or not 0 <= count <= sys.maxsize:
        raise error(f"{name}={value!r}: expected a number of bytes from 0 to 2**63 - 1: an "
                    "integer (6 * 2**30), a float (6e9) or a string with a unit ('6GiB', "
                    f"'512MB'; units: {', '.join(u for u in UNITS if u)}, any case)")
    return count
