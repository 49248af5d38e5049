"""A strength: the one check every entry point gives a user's strength (``merge_lora``,
``apply_lora``, ``attach_lora``, ``set_strength``, ``lora_scale``, the model cache, offloaders),
and :class:`Strengths`, the one place a dynamic attachment keeps its adapters' strengths.

A strength is a real number: a Python ``int``/``float``, a NumPy scalar, or a one-element
floating or integer tensor. ``True``/``False`` are refused (a flag passed where a number belongs
is a mistake), and so is anything beyond float32's range: dynamic adapters keep strengths in a
float32 tensor, where 1e308 becomes infinity.
"""

from __future__ import annotations

import math
import numbers
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from shuttle.errors import InvalidStrengthError

__all__ = ["FLOAT32_MAX", "Follower", "Strengths", "check_strength"]

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


class Follower(Protocol):
    """A layer captured into a CUDA graph: its combined-scale vector is rewritten in place
    whenever a scale it was computed from changes.
    """

    def refresh_graph_scale(self) -> None: ...


class Strengths(Sequence[float]):
    """The strengths of one dynamic attachment, held once for all its layers.

    What it holds, and who reads it:

    - the values, Python floats indexed by adapter (the exact tier, the weight residuals);
    - a ``(n_adapters,)`` float32 copy per device (:meth:`tensor`), written in place so that
      compiled code and captured graphs that read it follow every change;
    - ``generation``, a counter that :meth:`set` and :meth:`bump` advance: with the request
      scale, the key of a layer's cached combined scales (``alpha/r * strength * request``);
    - the followers: layers captured into a CUDA graph (which replays without Python, so it
      reads a vector the layer owns), whose vectors every change rewrites in place.

    One per attachment (:class:`~shuttle.apply.dynamic.DynamicAdapters`): a change reaches
    its own layers' caches and followers only, never another model's. What is process-wide is
    the request scale (:mod:`shuttle.apply.scale`), which refreshes every owner's followers.

    Args:
        values: a strength per adapter, checked (:func:`check_strength`).
    """

    def __init__(self, values: Sequence[float]):
        self._values = [float(v) for v in values]
        self._tensors: dict[torch.device, torch.Tensor] = {}
        self._followers: weakref.WeakSet[Follower] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.generation = 0

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, index: int) -> float:  # type: ignore[override]
        return self._values[index]

    def __iter__(self) -> Iterator[float]:
        return iter(list(self._values))

    def __repr__(self) -> str:
        return f"Strengths({self._values!r})"

    def tensor(self, device: torch.device) -> torch.Tensor:
        """``(n_adapters,)`` float32 strengths on ``device``, created once, written in place."""
        t = self._tensors.get(device)
        if t is None:
            with self._lock:
                t = self._tensors.setdefault(device, torch.tensor(
                    self._values, dtype=torch.float32, device=device))
        return t

    def set(self, wanted: Mapping[int, float]) -> None:
        """Write checked strengths (adapter index -> strength) into the values and every
        device copy, then :meth:`bump`.
        """
        for index, strength in wanted.items():
            self._values[index] = strength
            for t in self._tensors.values():
                t[index] = strength
        self.bump()

    def bump(self) -> None:
        """Note a change of what the layers' scales are computed from (a strength, or an
        adapter's factors swapped): cached scales go stale, followers are rewritten now.
        """
        with self._lock:
            self.generation += 1
        self.refresh_followers()

    def follow(self, layer: Follower) -> None:
        """Rewrite ``layer``'s vector on every change from now on (weakly held)."""
        self._followers.add(layer)

    def following(self, layer: Follower) -> bool:
        """Whether ``layer`` is a follower (a CUDA graph captured its vector)."""
        return layer in self._followers

    def refresh_followers(self) -> None:
        """Rewrite every follower's vector in place (on the current stream)."""
        for layer in list(self._followers):
            layer.refresh_graph_scale()
