"""Triton kernels, each with a pure-PyTorch reference beside it. Triton is imported lazily."""

from shuttle.kernels.launch import interpreting, triton_available
from shuttle.kernels.lora_decode import (
    PreparedLoraDecode,
    lora_decode_add,
    lora_decode_add_reference,
    lora_decode_linear,
    lora_decode_linear_reference,
)
from shuttle.kernels.lora_linear import FusedConfig, lora_linear_fused, lora_linear_fused_reference
from shuttle.kernels.lora_linear_tma import PreparedLoraLinear
from shuttle.kernels.lora_shrink import ShrinkConfig, lora_shrink, lora_shrink_reference
from shuttle.kernels.merge_lowrank import merge_lowrank, merge_lowrank_reference
from shuttle.kernels.merge_nf4 import merge_4bit, merge_4bit_reference
from shuttle.kernels.merge_scaled import ScaledMerge, merge_scaled, merge_scaled_reference

__all__ = [
    "FusedConfig",
    "PreparedLoraDecode",
    "PreparedLoraLinear",
    "ScaledMerge",
    "ShrinkConfig",
    "interpreting",
    "lora_decode_add",
    "lora_decode_add_reference",
    "lora_decode_linear",
    "lora_decode_linear_reference",
    "lora_linear_fused",
    "lora_linear_fused_reference",
    "lora_shrink",
    "lora_shrink_reference",
    "merge_4bit",
    "merge_4bit_reference",
    "merge_lowrank",
    "merge_lowrank_reference",
    "merge_scaled",
    "merge_scaled_reference",
    "triton_available",
]
