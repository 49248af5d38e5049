"""The math of every patch kind. Each gives its update in float32; low-rank ones a residual."""

from shuttle.patches.dense import Diff, Set
from shuttle.patches.dora import DoRA
from shuttle.patches.ia3 import IA3
from shuttle.patches.loha import LoHa
from shuttle.patches.lokr import LoKr
from shuttle.patches.lowrank import LowRank
from shuttle.patches.patch import PATCH_KINDS, Patch, TensorRef, materialize, register_patch
from shuttle.patches.replace import Replace
from shuttle.patches.select_rows import RowSlice, select_rows

__all__ = [
    "IA3",
    "PATCH_KINDS",
    "Diff",
    "DoRA",
    "LoHa",
    "LoKr",
    "LowRank",
    "Patch",
    "Replace",
    "RowSlice",
    "Set",
    "TensorRef",
    "materialize",
    "register_patch",
    "select_rows",
]
