"""What one activation keeps on the device: :class:`StreamConfig` (asked) and
:class:`ResidencyPlan` (chosen by :func:`plan_residency` from the host storage's unit sizes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shuttle.errors import BudgetTooSmallError, OffloadError
from shuttle.offload.host_storage import HostStorage

__all__ = ["ResidencyPlan", "StreamConfig", "plan_residency"]


@dataclass(frozen=True)
class StreamConfig:
    """How blocks stream during one activation.

    Args:
        prefetch: blocks loaded ahead of the one computing; each group's ring has
            ``prefetch + 1`` slots (fewer when it has fewer streamed blocks).
        resident: blocks per group kept on the device for the whole activation (spread evenly
            over the group); default 0. Exclusive with ``vram_budget``.
        vram_budget: device bytes for weights (the rest of the model, resident blocks and ring
            slots; activations are not counted). As many blocks as fit are made resident;
            when even ``prefetch`` is too deep for the budget it is lowered.
        compile: compile each block's forward with ``torch.compile`` (weight loading stays
            outside the graph; one compile per block class and shape): ``True`` for the
            default backend (inductor), or a backend (``"aot_eager"``, a callable).
            Needs block lists (``from_module(..., blocks=...)``).

    In layer mode ``prefetch`` counts layers, ``resident`` is the number of layers kept on
    the device (spread evenly), and ``vram_budget`` also pays for the layer ring
    (``prefetch + 1`` slots of the largest streamed layer) before any layer is made resident.

    Raises:
        OffloadError: a negative or non-integer value, both ``resident`` and
            ``vram_budget``, or a ``compile`` that is neither a bool, a string nor callable.
    """

    prefetch: int = 2
    resident: int | None = None
    vram_budget: int | None = None
    compile: bool | str | Callable[..., Any] = False

    def __post_init__(self) -> None:
        if not isinstance(self.compile, (bool, str)) and not callable(self.compile):
            raise OffloadError(f"StreamConfig.compile={self.compile!r}: expected a bool, a "
                               "backend name or a backend callable")
        for name in ("prefetch", "resident", "vram_budget"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise OffloadError(f"StreamConfig.{name}={v!r}: expected an integer >= 0")
        if self.resident is not None and self.vram_budget is not None:
            raise OffloadError("StreamConfig: give resident= or vram_budget=, not both "
                               "(the budget chooses the resident count)")


@dataclass(frozen=True)
class ResidencyPlan:
    """What one activation keeps on the device.

    Attributes:
        resident: per group, the positions of blocks kept on the device.
        ring: per group, the number of streaming slots (0: nothing streams).
        prefetch: the prefetch depth used (lowered from the config's to fit a budget).
        device_bytes: weight bytes on the device: the rest of the model plus every slot.
        layers: layer mode: positions (in ``storage.layers``) of the layers kept on the device.
        layer_ring: layer mode: the number of streaming slots for layers (0: none stream).
    """

    resident: dict[str, tuple[int, ...]] = field(default_factory=dict)
    ring: dict[str, int] = field(default_factory=dict)
    prefetch: int = 0
    device_bytes: int = 0
    layers: tuple[int, ...] = ()
    layer_ring: int = 0


def _spread(count: int, n: int) -> tuple[int, ...]:
    # Evenly spaced positions: copies of streamed blocks overlap resident blocks' compute.
    return tuple(sorted({int((j + 0.5) * n / count) for j in range(count)}))


def plan_residency(storage: HostStorage, config: StreamConfig | None) -> ResidencyPlan:
    """Choose resident blocks (and layers) and ring sizes for ``config`` (None: all resident).

    Raises:
        BudgetTooSmallError: ``config.vram_budget`` cannot hold the rest of the model plus
            one slot per group (and one slot of the largest layer, in layer mode).
    """
    rest = storage.rest.layout.nbytes
    sizes = {g: (len(us), us[0].layout.nbytes) for g, us in storage.groups.items()}
    layer_sizes = [u.layout.nbytes for u in storage.layers]
    n_layers = len(layer_sizes)

    def layer_cost(keep: tuple[int, ...], p: int) -> int:
        kept = set(keep)
        streamed = [b for i, b in enumerate(layer_sizes) if i not in kept]
        return (sum(layer_sizes[i] for i in kept)
                + min(p + 1, len(streamed)) * max(streamed, default=0))

    def cost(res: dict[str, int], p: int, keep: tuple[int, ...] = ()) -> int:
        return (rest + layer_cost(keep, p)
                + sum((res[g] + min(p + 1, n - res[g])) * b for g, (n, b) in sizes.items()))

    def plan(res: dict[str, int], p: int, keep: tuple[int, ...]) -> ResidencyPlan:
        return ResidencyPlan({g: _spread(res[g], n) if res[g] else () for g, (n, _) in
                              sizes.items()},
                             {g: min(p + 1, n - res[g]) for g, (n, _) in sizes.items()},
                             p, cost(res, p, keep), keep, min(p + 1, n_layers - len(keep)))

    if config is None:
        return plan({g: n for g, (n, _) in sizes.items()}, 0, tuple(range(n_layers)))
    if config.vram_budget is None:
        r = min(config.resident or 0, n_layers)
        return plan({g: min(config.resident or 0, n) for g, (n, _) in sizes.items()},
                    config.prefetch, _spread(r, n_layers) if r else ())
    budget, res = config.vram_budget, {g: 0 for g in sizes}
    if cost(res, 0) > budget:
        what = " and one slot of the largest layer" if n_layers else ""
        raise BudgetTooSmallError(
            f"vram_budget={budget} bytes cannot hold the non-block weights ({rest} bytes) plus "
            f"one slot per block group{what} ({cost(res, 0) - rest} bytes): give at least "
            f"{cost(res, 0)} bytes, or list more of the model under block paths"
        )
    p = next(q for q in range(config.prefetch, -1, -1) if cost(res, q) <= budget)
    grown = True
    while grown:  # one more resident block per group per round, while the budget allows
        grown = False
        for g, (n, _) in sizes.items():
            if res[g] < n:
                res[g] += 1
                if cost(res, p) <= budget:
                    grown = True
                else:
                    res[g] -= 1
    # Then as many layers as fit, spread evenly (their copies overlap the resident ones).
    keep = next((k for r in range(n_layers, 0, -1) if cost(res, p, k := _spread(r, n_layers))
                 <= budget), ())
    return plan(res, p, keep)
