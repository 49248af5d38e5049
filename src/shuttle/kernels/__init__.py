"""Triton kernels, each with a pure-PyTorch reference beside it. Triton is imported lazily."""

from shuttle.kernels.lora_linear import (
    FusedConfig,
    ShrinkConfig,
    lora_linear_fused,
    lora_linear_fused_reference,
    lora_shrink,
    lora_shrink_reference,
)
from shuttle.kernels.merge_lowrank import (
    interpreting,
    merge_lowrank,
    merge_lowrank_reference,
    triton_available,
)

__all__ = [
    "FusedConfig",
    "ShrinkConfig",
    "interpreting",
    "lora_linear_fused",
    "lora_linear_fused_reference",
    "lora_shrink",
    "lora_shrink_reference",
    "merge_lowrank",
    "merge_lowrank_reference",
    "triton_available",
]
