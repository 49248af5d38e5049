"""Triton kernels, each with a pure-PyTorch reference beside it. Triton is imported lazily."""

from shuttle.kernels.merge_lowrank import merge_lowrank, merge_lowrank_reference, triton_available

__all__ = ["merge_lowrank", "merge_lowrank_reference", "triton_available"]
