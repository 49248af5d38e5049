"""The matrix products the LoRA training functions are made of, each in as few launches as it
takes.

A rank-16 product is a small kernel, and launching it from Python costs the host about as much
time as it costs the GPU (a cuBLAS call is a workspace memset and a kernel). A LoRA layer's
forward and backward are a dozen such products around one or two large GEMMs, so their launch
count sets the host time of a training step:

- :func:`compute_factors`: every adapter factor of a function in the compute dtype (PEFT keeps
  float32 factors on a bf16 model) in two launches whatever their number (one ``cat`` in their
  own dtype, one cast), as views of one buffer.
- :func:`scaled_mm`: ``alpha * a @ b`` in one launch, written into ``out`` where given (a
  column window of a wider buffer included: the GEMM takes its row stride, so rank-sized
  results of several adapters land side by side with no ``cat``).
- :func:`grad_mm`: ``alpha * a @ b`` in a parameter's dtype. On CUDA a float32 gradient of
  bf16/fp16 operands comes out of the GEMM (``out_dtype``, the scale as its ``alpha``): one
  launch, and no bf16 rounding of the gradient on the way; elsewhere a product and a cast.

The order the functions launch in. The attention projections' functions queue the base
GEMMs before the rank-sized work both ways: the GPU runs them while the host makes the
adapters' launches, and a step's last launches are small ones that the GPU finishes soon after
the host's last call (their expands add into the outputs with ``addmm_``). The gated MLP, whose
GEMMs outlast any launch sequence, starts its backward's ``dh`` and ``dx`` from the adapters'
``u A`` and accumulates ``dy W`` into them: a GEMM reads its ``C`` operand in the epilogue of a
compute-bound product for free, where an ``addmm_`` of ``u A`` after it would read and write
the (T, F) gradient once more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shuttle.train.frozen import FrozenLinear

__all__ = ["as_dtype", "base_product", "compute_factors", "grad_mm", "scaled_mm"]

_HALF = (torch.bfloat16, torch.float16)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (``t`` itself when it is)."""
    return t if t.dtype == dtype else t.to(dtype)


def compute_factors(dtype: torch.dtype, a_list: Sequence[torch.Tensor],
                    b_list: Sequence[torch.Tensor]
                    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``(cat(a_list) in dtype, [b in dtype for b in b_list])`` in one launch.

    ``a_list``: ``(r_i, K)`` each (one K; may be empty: None comes back); ``b_list``: any
    shapes. Factors already in ``dtype`` are used as they are (only the ``A`` rows are
    concatenated); otherwise every factor is cast into one flat buffer by a single
    ``torch.cat`` and handed back as views of it.
    """
    if all(t.dtype == dtype for t in (*a_list, *b_list)):
        a_all = None if not a_list else a_list[0] if len(a_list) == 1 else torch.cat(a_list)
        return a_all, list(b_list)
    flat = [t.reshape(-1) for t in (*a_list, *b_list)]
    # cat's kernel casts input by input into an output of another dtype: cat first, then cast
    buf = (flat[0] if len(flat) == 1 else torch.cat(flat)).to(dtype)
    views, at = [], 0
    a_all = None
    if a_list:
        rows, k = sum(a.shape[0] for a in a_list), a_list[0].shape[1]
        a_all, at = buf[:rows * k].view(rows, k), rows * k
    for b in b_list:
        views.append(buf[at:at + b.numel()].view(b.shape))
        at += b.numel()
    return a_all, views


def scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: float,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha * a @ b``, into ``out`` when given (which may be a column window of a wider
    row-major buffer); one launch.
    """
    if out is None:
        if alpha == 1:
            return a @ b
        out = a.new_empty(a.shape[0], b.shape[1])
    return torch.addmm(out, a, b, beta=0, alpha=alpha, out=out)


def grad_mm(a: torch.Tensor, b: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """``alpha * a @ b`` in ``dtype``: a parameter's gradient from compute-dtype operands."""
    if a.is_cuda and dtype == torch.float32 and a.dtype in _HALF and b.dtype == a.dtype:
        # the float32 accumulator, unrounded; beta = 0: the empty C is never read
        if alpha == 1:
            return torch.mm(a, b, out_dtype=dtype)
        return torch.addmm(a.new_empty(a.shape[0], b.shape[1], dtype=dtype), a, b, beta=0,
                           alpha=alpha, out_dtype=dtype)
    return as_dtype(scaled_mm(a, b, alpha), dtype)


def base_product(x2: torch.Tensor, base: FrozenLinear) -> torch.Tensor:
    """``x W^T + bias`` (T, N) in ``x``'s dtype."""
    bias = None if base.bias is None else as_dtype(base.bias, x2.dtype)
    return torch.nn.functional.linear(x2, base.weight(x2.dtype), bias)
