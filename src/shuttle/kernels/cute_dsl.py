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

__all__ = ["CUTE_DTYPES", "CUTE_TILES", "CuteTile", "dsl", "numeric"]


@dataclasses.dataclass(frozen=True)
class CuteTile:
    """One CTA's output tile (``m`` x ``n``) and its K step; ``consumers`` warpgroups share the
    ``m`` rows, 64 each (a wgmma instruction's rows): one warpgroup over 128 rows would issue
    both halves' instructions in turn and hold both accumulators.
    """

    m: int = 128
    n: int = 256
    k: int = 64

    @property
    def consumers(self) -> int:
        return self.m // 64


# The tiles tried by the tier chooser: 128 x 256 fills the SMs' rounds at long sequences,
# 128 x 128 at shorter ones (the same trade as the Triton kernel's two configurations).
CUTE_TILES: tuple[CuteTile, ...] = (CuteTile(128, 256, 64), CuteTile(128, 128, 64))

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
