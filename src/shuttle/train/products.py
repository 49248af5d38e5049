"""The matrix products the LoRA training functions are made of, each in as few launches as it
takes.

A rank-16 product is a small kernel, and launching it from Python costs the host about as much
time as it costs the GPU (a cuBLAS call is a workspace memset and a kernel). A LoRA layer's
forward and backward are a dozen such products around one or two large GEMMs, so their launch
count sets the host time of a training step:

- :func:`compute_factors`: every adapter factor of a function in the compute dtype (PEFT keeps
  float32 factors on a bf16 model) in one or two launches whatever their number, the ``A``
  factors as row blocks of one matrix.
- :func:`scaled_mm`: ``alpha * a @ b`` in one launch, written into ``out`` where given (a
  column window of a wider buffer included: the GEMM takes its row stride, so rank-sized
  results of several adapters land side by side with no ``cat``).
- :func:`adapted_product`: ``x W^T + bias + scale * h B^T`` for a rank-sized ``h``: the
  expand written first (:func:`expand`), the base GEMM accumulated into it (:func:`add_base`).
- :func:`grad_mm`: ``alpha * a @ b`` in a parameter's dtype. On CUDA a float32 gradient of
  bf16/fp16 operands comes out of the GEMM (``out_dtype``, the scale as its ``alpha``): one
  launch, and no bf16 rounding of the gradient on the way; elsewhere a product and a cast.

The order the functions launch in. A step's host time is close to its GPU time, so the GPU
idles wherever the host is launching small kernels with no large GEMM queued ahead of them;
and a GEMM reads its ``C`` operand in the epilogue of a compute-bound product at almost no
cost, where an ``addmm_`` of an expand after it reads and writes the whole (T, N) output once
more. So each output starts from its adapter's expand and the base GEMM accumulates into it
(:func:`adapted_product`; backward ``dx = u A``, then ``dx += dy W``), except where a large
GEMM must be queued first: the attention projections' forward, often the first work of a
step, queues the base GEMMs of its narrower projections (GQA's k and v) before anything else
(their expands are added after, with ``addmm_``), and the backward of a layer or of the
projections queues its first ``dy W`` as soon as ``u`` exists, with the adapters' gradients
launched while it runs (the gated MLP's backward does so for its down projection, whose GEMM
covers the launches after it; its gate and up GEMMs come last, after the adapters' gradients).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shuttle.train.frozen import FrozenLinear

__all__ = ["adapted_product", "add_base", "as_dtype", "as_rows", "base_product", "compute_factors",
           "expand", "grad_mm", "like_rows", "scaled_mm", "shrink", "split_columns"]

_HALF = (torch.bfloat16, torch.float16)
_FOREACH_CHUNK = 65536  # elements per thread block of CUDA's multi-tensor kernels


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (``t`` itself when it is)."""
    return t if t.dtype == dtype else t.to(dtype)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., K) as a (T, K) matrix (``t`` itself when it is one)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def like_rows(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``y`` (T, N) with the leading dimensions of ``t`` (..., K): (..., N)."""
    return y if t.dim() == 2 else y.view(*t.shape[:-1], y.shape[-1])


def split_columns(t: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """``t``'s column windows of ``sizes`` (``(t,)`` for one)."""
    return (t,) if len(sizes) == 1 else t.split_with_sizes(sizes, dim=1)


def compute_factors(dtype: torch.dtype, a_list: Sequence[torch.Tensor],
                    b_list: Sequence[torch.Tensor]
                    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``(cat(a_list) in dtype, [b in dtype for b in b_list])`` in one or two launches.

    ``a_list``: ``(r_i, K)`` each (one K; may be empty: None comes back); ``b_list``: any
    shapes. Factors already in ``dtype`` are used as they are (only the ``A`` rows are
    concatenated). Otherwise every factor lands in one flat buffer, the ``A`` rows first, and
    comes back as a view of it: small factors copied in by a single ``torch._foreach_copy_``
    (one multi-tensor kernel on CUDA), large ones by one flattening ``cat`` and one cast. The
    multi-tensor kernel gives each :data:`_FOREACH_CHUNK`-element chunk of a tensor one thread
    block, so factors of a wide layer (a rank-16 ``A`` of a 4096-wide one is one whole chunk)
    would run on a handful of SMs: several times the two well-spread kernels' time. The views
    are made by ``unflatten_dense_tensors`` in one call (this runs at every call of every
    layer).
    """
    if all(t.dtype == dtype for t in (*a_list, *b_list)):
        a_all = None if not a_list else a_list[0] if len(a_list) == 1 else torch.cat(a_list)
        return a_all, list(b_list)
    factors = [*a_list, *b_list]
    if max(t.numel() for t in factors) > _FOREACH_CHUNK // 4:
        flat = _flatten_dense_tensors(factors).to(dtype)
        views = _unflatten_dense_tensors(flat, factors)
    else:
        flat = factors[0].new_empty(sum(t.numel() for t in factors), dtype=dtype)
        views = _unflatten_dense_tensors(flat, factors)
        torch._foreach_copy_(views, factors)
    n_a = len(a_list)
    if n_a <= 1:
        a_all = views[0] if n_a else None
    else:  # the A rows, adjacent in flat
        a_all = flat[:sum(a.numel() for a in a_list)].view(-1, a_list[0].shape[1])
    return a_all, list(views[n_a:])


def scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: float,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha * a @ b``, into ``out`` when given (which may be a column window of a wider
    row-major buffer); one launch.
    """
    if torch.compiler.is_compiling():
        # Dynamo traces no ``out=`` into a column window (the function would leave the graph):
        # a new product, scaled and copied into the window (pointwise work Inductor fuses). No
        # ``addmm`` of an empty C with beta = 0 here: on CUDA, Inductor may rewrite an addmm
        # whose users are pointwise into ``beta * C + mm``, and 0 * NaN of uninitialized memory
        # is NaN. In half precision the product is rounded before the scale (one rounding more
        # than eager's alpha inside the GEMM; none for a power-of-two scale)
        res = a @ b if alpha == 1 else (a @ b) * alpha
        return res if out is None else out.copy_(res)
    if out is None:
        if alpha == 1:
            return a @ b
        out = a.new_empty(a.shape[0], b.shape[1])
    return torch.addmm(out, a, b, beta=0, alpha=alpha, out=out)


def grad_mm(a: torch.Tensor, b: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """``alpha * a @ b`` in ``dtype``: a parameter's gradient from compute-dtype operands."""
    if a.is_cuda and dtype == torch.float32 and a.dtype in _HALF and b.dtype == a.dtype:
        # the float32 accumulator, unrounded; beta = 0: the empty C is never read (traced, the
        # scale is a pointwise product instead: see scaled_mm)
        if alpha == 1 or torch.compiler.is_compiling():
            prod = torch.mm(a, b, out_dtype=dtype)
            return prod if alpha == 1 else prod * alpha
        return torch.addmm(a.new_empty(a.shape[0], b.shape[1], dtype=dtype), a, b, beta=0,
                           alpha=alpha, out_dtype=dtype)
    return as_dtype(scaled_mm(a, b, alpha), dtype)


def shrink(x2: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``x A^T`` (T, r) for ``x`` (T, K), ``a`` (r, K): one launch, the transpose taken inside
    the op (no Python-level view: this runs for every adapter at every call).
    """
    return torch.nn.functional.linear(x2, a)


def expand(h: torch.Tensor, b: torch.Tensor, scale: float,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``scale * h B^T + bias`` (T, N) for ``h`` (T, r), ``b`` (N, r); one launch."""
    if bias is None:
        return scaled_mm(h, b.T, scale)
    return torch.addmm(as_dtype(bias, h.dtype), h, b.T, alpha=scale)


def add_base(out: torch.Tensor, x2: torch.Tensor, base: FrozenLinear) -> torch.Tensor:
    """``out += x W^T`` (the base weight in ``x``'s dtype), in place; ``out`` returned."""
    return out.addmm_(x2, base.weight(x2.dtype).T)


def adapted_product(x2: torch.Tensor, base: FrozenLinear, h: torch.Tensor, b: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """``x W^T + bias + scale * h B^T`` (T, N) in ``x``'s dtype; ``h`` (T, r), ``b`` (N, r):
    the expand first, the base GEMM adding into it through its ``C`` operand.
    """
    return add_base(expand(h, b, scale, base.bias), x2, base)


def base_product(x2: torch.Tensor, base: FrozenLinear) -> torch.Tensor:
    """``x W^T + bias`` (T, N) in ``x``'s dtype."""
    bias = None if base.bias is None else as_dtype(base.bias, x2.dtype)
    return torch.nn.functional.linear(x2, base.weight(x2.dtype), bias)
