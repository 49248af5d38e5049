"""Applying adapters to models: permanent and scoped merges, dynamic (forward-time) adapters."""

from shuttle.apply.dynamic import DynamicAdapters, attach_lora
from shuttle.apply.merge import MergeReport, merge_lora
from shuttle.apply.plan import MergePlan, plan_merge
from shuttle.apply.rounding import round_to, stochastic_round
from shuttle.apply.scale import lora_scale
from shuttle.apply.scoped import apply_lora

__all__ = [
    "DynamicAdapters",
    "MergePlan",
    "MergeReport",
    "apply_lora",
    "attach_lora",
    "lora_scale",
    "merge_lora",
    "plan_merge",
    "round_to",
    "stochastic_round",
]
