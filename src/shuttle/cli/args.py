"""Argument types the subcommands share, so one spelling works everywhere.

Each raises ``argparse.ArgumentTypeError``: argparse prints the message with the usage and exits
with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable

import torch

from shuttle.errors import DeviceUnavailableError
from shuttle.integrations.budgets import check_device

__all__ = ["DTYPE_SPELLINGS", "device_arg", "dtype_arg", "fraction_arg", "positive_int_arg"]

# Every spelling of a dtype a user may type: the short one (bf16) and torch's (bfloat16).
DTYPE_SPELLINGS: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
}


def dtype_arg(allowed: Iterable[torch.dtype]) -> Callable[[str], torch.dtype]:
    """An argparse ``type`` taking any spelling (``bf16`` or ``bfloat16``) of an ``allowed``
    dtype and giving the ``torch.dtype``.
    """
    allowed = tuple(allowed)
    names = ", ".join(f"{short} ({str(d).removeprefix('torch.')})" for short, d in
                      DTYPE_SPELLINGS.items() if d in allowed and short[0] in "bf" and
                      not short.startswith(("float", "bfloat")))

    def parse(text: str) -> torch.dtype:
        dtype = DTYPE_SPELLINGS.get(text.strip().lower())
        if dtype not in allowed:
            raise argparse.ArgumentTypeError(f"{text!r} is not a dtype here; pass one of {names}")
        return dtype

    parse.__name__ = "dtype"  # argparse names the type in its messages
    return parse


def positive_int_arg(text: str) -> int:
    """A whole number >= 1 (a rank)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: pass a whole number >= 1, e.g. 16")
    return value


def fraction_arg(text: str) -> float:
    """A number in (0, 1] (an energy fraction)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: pass a fraction in (0, 1], e.g. 0.99")
    return value


def device_arg(text: str) -> torch.device:
    """A device this machine has (``cuda`` without CUDA is refused here, not at first use)."""
    try:
        return check_device(text, "--device")
    except DeviceUnavailableError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
