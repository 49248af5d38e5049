"""The math of every patch kind (each gives its update in float32; low-rank ones a residual),
and each kind as one registered object (:class:`PatchKind`: roles, construction, spelling,
dynamic form) in :data:`PATCH_KINDS`.
"""

from shuttle.patches.dense import Diff, Set
from shuttle.patches.dora import DoRA
from shuttle.patches.experts import ExpertsLowRank
from shuttle.patches.ia3 import IA3
from shuttle.patches.kind import PATCH_KINDS, Found, PatchKind, register_kind, register_patch
from shuttle.patches.loha import LoHa
from shuttle.patches.lokr import LoKr
from shuttle.patches.lowrank import LowRank
from shuttle.patches.oft import OFT
from shuttle.patches.patch import Patch, TensorRef, materialize
from shuttle.patches.replace import Replace, ReplaceRows
from shuttle.patches.select_rows import RowSlice, select_rows

__all__ = [
    "IA3",
    "OFT",
    "PATCH_KINDS",
    "Diff",
    "DoRA",
    "ExpertsLowRank",
    "Found",
    "LoHa",
    "LoKr",
    "LowRank",
    "Patch",
    "PatchKind",
    "Replace",
    "ReplaceRows",
    "RowSlice",
    "Set",
    "TensorRef",
    "materialize",
    "register_kind",
    "register_patch",
    "select_rows",
]
