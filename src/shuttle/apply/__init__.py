"""Applying adapters to models: permanent and scoped merges."""

from shuttle.apply.merge import MergeReport, merge_lora
from shuttle.apply.plan import MergePlan, plan_merge
from shuttle.apply.rounding import round_to, stochastic_round
from shuttle.apply.scoped import apply_lora

__all__ = [
    "MergePlan",
    "MergeReport",
    "apply_lora",
    "merge_lora",
    "plan_merge",
    "round_to",
    "stochastic_round",
]
