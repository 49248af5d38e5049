"""The CuTe DSL (``nvidia-cutlass-dsl``, the ``hopper`` extra), imported on first use, and what
the CuTe kernels share: the CTA tiles they are compiled for and the element types they take.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import types
from typing import Any

import torch

__all__ = ["CUTE_DTYPES", "CUTE_TILES", "PINGPONG_TILES", "CuteTile", "best_tile", "dsl",
           "numeric"]


@dataclasses.dataclass(frozen=True)
class CuteTile:
    """One CTA's output tile (``m`` x ``n``) and its K step; ``consumers`` warpgroups share the
    ``m`` rows, 64 each (a wgmma instruction's rows), or with ``pingpong`` take turns, each over
    all ``m`` rows of its own units (both halves' instructions, both accumulators).
    """

    m: int = 128
    n: int = 256
    k: int = 64
    # Time per output element relative to 128 x 256 at full rounds (what :func:`best_tile`
    # weighs): a warpgroup's 64 x n wgmma reads its B operand from shared memory once per 64
    # rows, so narrower tiles move more bytes per multiply-add.
    cost: float = dataclasses.field(default=1.0, compare=False)
    # Ping-pong: each of two warpgroups takes its own units (the whole m x n tile, its
    # accumulator n registers a thread), their main loops in turn, so one's epilogue runs
    # under the other's main loop; else both share each unit, 64 rows each.
    pingpong: bool = False

    @property
    def consumers(self) -> int:
        return 2 if self.pingpong else self.m // 64


# The tiles a layer's calls choose among by their rows (:func:`best_tile`): the widest costs
# least per element; the narrower ones fill the SMs' rounds better (1536 columns at 4096 rows:
# 192 tiles of 128 x 256 fill 73% of two rounds of 132 SMs, 256 tiles of 128 x 192 97%).
CUTE_TILES: tuple[CuteTile, ...] = (CuteTile(128, 256, 64), CuteTile(128, 192, 64, cost=1.03),
                                    CuteTile(128, 128, 64, cost=1.18))
# The ping-pong tiles: their epilogues hidden, but one warpgroup's main loop runs slower per K
# step than two sharing a tile, so they win at short reductions and lose at long ones, and the
# same shape has gone both ways between runs on one card: they are not weighed by a cost but
# measured per layer shape by the tier chooser, as a form of its own (``fused_cute_pingpong``).
# 128 x 192: the widest whose accumulator (n registers a thread) fits beside the main loop's.
PINGPONG_TILES: tuple[CuteTile, ...] = (CuteTile(128, 192, 64, pingpong=True),)


@functools.lru_cache(maxsize=1024)  # asked per call: a lookup costs less host time
def best_tile(t: int, n: int, sms: int, shrink: bool = False, pingpong: bool = False
              ) -> CuteTile:
    """The tile of :data:`CUTE_TILES` (:data:`PINGPONG_TILES` with ``pingpong``) whose units
    finish first for ``t`` rows and ``n`` columns on ``sms`` SMs: rounds of units (output tiles,
    and S tiles with the ``shrink``) times a unit's cost. Ties go to the earlier tile.
    """
    def finish(tile: CuteTile) -> float:
        rows = -(-t // tile.m)
        units = rows * -(-n // tile.n) + (-(-rows * tile.m // tile.n) if shrink else 0)
        return -(-units // sms) * tile.m * tile.n * tile.cost

    # a flag, not the tuple, in the cached call's key: hashing the tiles costs each call
    return min(PINGPONG_TILES if pingpong else CUTE_TILES, key=finish)

CUTE_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def dsl() -> Any:
    """The DSL's modules, imported on first use (an optional dependency)."""
    from shuttle.optional import import_optional

    install = 'pip install "shuttle[hopper]"'
    # The wheel puts its packages on sys.path through a .pth file; an install with --target
    # (no site processing) needs the path added here.
    pkg = importlib.util.find_spec("nvidia_cutlass_dsl")
    if pkg is not None and importlib.util.find_spec("cutlass") is None:
        import os
        import sys

        for root in pkg.submodule_search_locations or ():
            sys.path.insert(0, os.path.join(root, "dsl_packages"))
    cutlass = import_optional("cutlass", "the CuTe fused LoRA kernel", install)
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.runtime import make_ptr

    return types.SimpleNamespace(cutlass=cutlass, cute=cute, pipeline=pipeline, utils=utils,
                                 sm90=sm90, make_ptr=make_ptr)


def numeric(dtype: torch.dtype) -> Any:
    """The DSL's element type for a torch dtype (bfloat16 or float16)."""
    cutlass = dsl().cutlass
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]
