"""The one check every entry point gives a user's strength (``merge_lora``, ``apply_lora``,
``attach_lora``, ``set_strength``, ``lora_scale``, the model cache, offloaders).

A strength is a real number: a Python ``int``/``float``, a NumPy scalar, or a one-element
floating or integer tensor. ``True``/``False`` are refused (a flag passed where a number belongs
is a mistake), and so is anything beyond float32's range: dynamic adapters keep strengths in a
float32 tensor, where 1e308 becomes infinity.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from shuttle.errors import InvalidStrengthError

__all__ = ["FLOAT32_MAX", "check_strength"]

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def check_strength(value: Any, what: str = "strength") -> float:
    """``value`` as a float, or :class:`InvalidStrengthError` naming ``what`` and the fix.

    Args:
        value: the strength the user passed.
        what: how the message names it (``"loras[2] strength"``, ``"set_strength(0, ...)"``).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise InvalidStrengthError(
                f"{what} is a tensor of shape {tuple(value.shape)} and dtype {value.dtype}; "
                "a strength is one real number: pass a float (e.g. 0.8)."
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidStrengthError(
            f"{what} is {value!r} ({type(value).__name__}); a strength is a real number: pass "
            "a float (e.g. 0.8)."
        )
    x = float(value)
    if not math.isfinite(x) or abs(x) > FLOAT32_MAX:
        raise InvalidStrengthError(
            f"{what} is {value!r}; a strength must be finite and within float32's range "
            f"(|strength| <= {FLOAT32_MAX:.4g}); typical strengths are between -2 and 2."
        )
    return x
