"""Applying adapters: merges (permanent, scoped, file to file, at load), dynamic adapters.

``merge_files`` is re-exported by ``shuttle`` only: here the name is its module's.
"""

from shuttle.apply.auto import AutoReport
from shuttle.apply.dynamic import DynamicAdapters, attach_lora
from shuttle.apply.extract import ExtractReport, extract_lora
from shuttle.apply.load import LoadReport, load_checkpoint, replacement_parameters
from shuttle.apply.memo import MergeMemo, clear_memo, memo_of
from shuttle.apply.merge import MergeReport, merge_lora
from shuttle.apply.notes import Note
from shuttle.apply.plan import MergePlan, plan_merge
from shuttle.apply.report import AdapterReport
from shuttle.apply.rounding import round_to, stochastic_round
from shuttle.apply.scale import lora_scale
from shuttle.apply.scaled_stream import scaled_stream
from shuttle.apply.scoped import apply_lora
from shuttle.apply.unmerge import UnmergeReport, unmerge_lora

__all__ = [
    "AdapterReport",
    "AutoReport",
    "DynamicAdapters",
    "ExtractReport",
    "LoadReport",
    "MergeMemo",
    "MergePlan",
    "MergeReport",
    "Note",
    "apply_lora",
    "attach_lora",
    "clear_memo",
    "extract_lora",
    "load_checkpoint",
    "lora_scale",
    "memo_of",
    "merge_lora",
    "plan_merge",
    "replacement_parameters",
    "round_to",
    "scaled_stream",
    "stochastic_round",
    "UnmergeReport",
    "unmerge_lora",
]
