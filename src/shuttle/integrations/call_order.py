"""``CallOrder``: the order a handle's modules are called in, learned from the calls.

A pipeline calls its modules in the same order at every call (Flux: CLIP, T5, the transformer
once a step, the VAE's decode; then the next image's CLIP). The handle records each call made
from outside its modules (:meth:`CallOrder.saw`) and, while one module runs, activates the
modules called after it (:meth:`CallOrder.after`) as far as their weights fit: their copies
then run under that module's compute instead of before their own calls, e.g. the next image's
text encoders under the VAE's decode, which copies nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["CallOrder"]


class CallOrder:
    """Which module was called after which, as last seen."""

    def __init__(self) -> None:
        self._next: dict[str, str] = {}
        self._last: str | None = None

    def saw(self, name: str) -> None:
        """A call of ``name`` begins (a module calling itself again, a step loop, is one)."""
        if self._last is not None and self._last != name:
            self._next[self._last] = name
        self._last = name

    def after(self, name: str) -> Iterator[str]:
        """The modules called after ``name``, nearest first, each once, up to ``name``."""
        seen = {name}
        following = self._next.get(name)
        while following is not None and following not in seen:
            seen.add(following)
            yield following
            following = self._next.get(following)
