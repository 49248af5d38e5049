"""``CallOrder``: the order a handle's modules are called in, learned from the calls.

A pipeline calls its modules in the same order at every call (Flux: CLIP, T5, the transformer
once a step, the VAE's decode; then the next image's CLIP). The handle records each call made
from outside its modules (:meth:`CallOrder.saw`) and, while one module runs, activates the
modules called after it (:meth:`CallOrder.after`) as far as their weights fit: their copies
then run under that module's compute instead of before their own calls, e.g. the next image's
text encoders under the VAE's decode, which copies nothing. A module called once a round (not a
step loop's denoiser) may be activated ahead with fewer blocks resident than its own plan keeps
(:meth:`CallOrder.once`): it copies all of its weights at every call either way.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping

from shuttle.errors import BudgetTooSmallError
from shuttle.integrations.component import Component
from shuttle.offload import ModelOffloader, ResidencyPlan, StreamConfig

__all__ = ["CallOrder"]


class CallOrder:
    """Which module was called after which, as last seen."""

    def __init__(self) -> None:
        self._next: dict[str, str] = {}
        self._runs: dict[str, tuple[int, int]] = {}  # (finished turns, most calls in one)
        self._last: str | None = None
        self._run = 0

    def saw(self, name: str) -> bool:
        """A call of ``name`` begins; whether it begins a turn (calls of one module in a row
        are one turn).
        """
        if self._last == name:
            self._run += 1
            return False
        if self._last is not None:
            turns, most = self._runs.get(self._last, (0, 0))
            self._next[self._last] = name
            self._runs[self._last] = (turns + 1, max(most, self._run))
        self._last, self._run = name, 1
        return True

    def once(self, name: str) -> bool:
        """Whether ``name`` was called once a turn in each of its finished turns, two at least
        (a pipeline's first call may be a warm-up of one step).
        """
        turns, most = self._runs.get(name, (0, 0))
        return turns >= 2 and most == 1

    def after(self, name: str) -> Iterator[str]:
        """The modules called after ``name``, nearest first, each once, up to ``name``."""
        seen = {name}
        following = self._next.get(name)
        while following is not None and following not in seen:
            seen.add(following)
            yield following
            following = self._next.get(following)

    def ahead(self, name: str, room: int, components: Mapping[str, Component],
              offloaders: Mapping[str, ModelOffloader], active: Container[str], prefetch: int
              ) -> Iterator[tuple[Component, ResidencyPlan]]:
        """The modules to activate while ``name`` runs, each with the plan to activate it by:
        those called after it, nearest first (the active ones skipped), while their device
        bytes fit in ``room``; one called once a turn with fewer blocks resident (its own
        ``prefetch``) when its plan does not fit. It stops at a module not measured yet (its
        plan may change) or reading from disk (the host would wait for the reads).
        """
        for following in self.after(name):
            if following in active:  # checked as the caller activates what came before
                continue
            c = components[following]
            plan = c.plan
            if c.reserve is None or c.share is not None or plan is None:
                return
            if plan.device_bytes > room:
                if not (c.paths and self.once(following)) or c.floor > room:
                    return
                try:
                    plan = offloaders[following].plan_for(
                        StreamConfig(prefetch=prefetch, vram_budget=room))
                except BudgetTooSmallError:  # below its floor
                    return
            yield c, plan
            room -= plan.device_bytes
