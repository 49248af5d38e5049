"""How the LoRA linear kernels are launched: the rules their host sides share.

:mod:`shuttle.kernels.lora_shrink` (``S = (x @ A.T) * scale``), :mod:`shuttle.kernels.lora_linear`
(``x @ W.T + S @ B.T + bias``) and :mod:`shuttle.kernels.lora_linear_tma` (both on Hopper) read
here the fused kernels' launch parameters (:class:`FusedConfig`), the row count up to which a
call is decode-sized (:data:`SMALL_T`), when a kernel runs at all, else the PyTorch reference
(:func:`use_kernel`), the references' accumulation dtype (:func:`acc_dtype`), operand layout
(:func:`unit_stride`), whether a dot runs in IEEE float32 (:func:`ieee_dot`), and the fit of a
reduction step's staged tiles in shared memory (:func:`fit_step`).

Numerics, for every kernel of the three: products of bf16/fp16 operands are exact in float32,
so a kernel equals its PyTorch reference up to float32 summation order, which can move a
rounded result by one ulp in rare cases. float32 factors keep float32 math (an IEEE float32
dot; activations are upcast inside the kernel). The reference is plain PyTorch; it is the
fallback where Triton is missing, the tensors are on the CPU without ``TRITON_INTERPRET=1``, or
autograd is recording (the kernels have no backward).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shuttle.kernels.launch import triton_available

__all__ = ["SMALL_T", "FusedConfig", "acc_dtype", "fit_step", "ieee_dot", "unit_stride",
           "use_kernel"]

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class FusedConfig(NamedTuple):
    """Launch parameters of the fused kernel (a plain tuple in this order works too)."""

    block_t: int  # output rows per program; 0: the next power of two >= T, 16 to 64
    block_n: int  # output columns per program
    block_k: int  # base reduction step
    block_r: int  # most ranks per rank-loop step (>= 16)
    group: int  # row tiles per group in the swizzled program order (L2 reuse of W tiles)
    num_warps: int
    num_stages: int


# Rows at or below which a call is decode-sized: the fused kernel's small-T configuration, and
# never the TMA path.
SMALL_T = 64


def acc_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32, or float64 when an input is float64 (never less precise than the inputs)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def use_kernel(interpret: bool, *tensors: torch.Tensor | None) -> bool:
    """Whether the Triton kernel runs on these operands (else the PyTorch reference): Triton is
    there, every dtype is one the kernels take, autograd is not recording through them (the
    kernels have no backward), and they are on CUDA or ``interpret`` is set. The first of
    ``tensors`` must be present.
    """
    present = [t for t in tensors if t is not None]
    if not triton_available():
        return False
    if any(t.dtype not in _KERNEL_DTYPES for t in present):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return False  # the kernels have no backward; the reference is differentiable
    return present[0].is_cuda or interpret


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dimension (copied only when it has not)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def ieee_dot(a: torch.dtype, b: torch.dtype, interpret: bool) -> bool:
    """Whether a dot of these operand dtypes runs as an IEEE float32 dot (else a native one)."""
    return a != b or a == torch.float32 or interpret


_SMEM_BUDGET = 160 * 1024  # staged operand tiles; sm_90 allows 227 KiB per block


def fit_step(step: int, rows: int, cols: int, a_bytes: int, b_bytes: int, stages: int) -> int:
    """Halve a reduction step (down to 16) until ``stages`` staged tiles fit the budget."""
    while step > 16 and stages * step * (rows * a_bytes + cols * b_bytes) > _SMEM_BUDGET:
        step //= 2
    return step
