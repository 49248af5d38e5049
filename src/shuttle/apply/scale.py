"""Per-request scaling of every active dynamic adapter: ``with shuttle.lora_scale(0.5): ...``.

The scale lives in one 0-dim float32 tensor per device, updated in place, so a compiled model
reads a new value without recompiling. Eager-mode layers cache their combined scales and notice a
change through :func:`generation`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from shuttle.apply.strength import check_strength

__all__ = ["generation", "lora_scale", "request_scale", "request_scale_value"]

_lock = threading.Lock()
_value = 1.0
_tensors: dict[torch.device, torch.Tensor] = {}
_generation = 0


def request_scale(device: torch.device) -> torch.Tensor:
    """The current request scale as a 0-dim float32 tensor on ``device``."""
    t = _tensors.get(device)
    if t is None:
        t = _tensors[device] = torch.full((), _value, dtype=torch.float32, device=device)
    return t


def request_scale_value() -> float:
    """The current request scale as a Python float (for the exact tier)."""
    return _value


def generation() -> int:
    """A counter that changes whenever any scale or strength of a dynamic adapter changes."""
    return _generation


def bump_generation() -> None:
    """Note that a strength changed (cached combined scales are stale)."""
    global _generation
    with _lock:
        _generation += 1


@contextlib.contextmanager
def lora_scale(scale: float) -> Iterator[None]:
    """Scale every active dynamic adapter by ``scale`` inside the block, without touching models.

    Raises:
        InvalidStrengthError: ``scale`` is not a finite number.
    """
    global _value
    scale = check_strength(scale, f"lora_scale({scale!r})")
    with _lock:
        previous = _value
        _set(float(scale))
    try:
        yield
    finally:
        with _lock:
            _set(previous)


def _set(value: float) -> None:
    global _value, _generation
    _value = value
    _generation += 1
    for t in _tensors.values():
        t.fill_(value)
