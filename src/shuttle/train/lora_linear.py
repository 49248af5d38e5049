"""A LoRA linear layer with a hand-derived backward: ``y = x W^T + b + s * d(x) A^T B^T``.

Shapes: ``x`` (T, K) (any leading dims), ``W`` (N, K) frozen, ``A`` (r, K), ``B`` (N, r), ``s``
the LoRA scale, ``d`` dropout (identity at p = 0, or outside training). With ``xd = d(x)`` and
``h = xd A^T`` (T, r), the gradients are, for ``dy`` (T, N):

    u   = s * dy B                   (T, r)
    dA  = u^T xd                     (r, K)
    dB  = s * dy^T h                 (N, r)
    dx  = dy W + mask * (u A)        (T, K)   (mask: dropout's, scaled by 1/(1-p))

Saved for backward: ``xd`` (the input itself at p = 0; with dropout the dropped input, never
both: the frozen base needs no activation), ``h``, which is r/K the size of ``x``, and the
factors in the compute dtype. Dropout's mask is not saved: it is drawn from a generator seeded
per call (from the default CPU generator, so ``torch.manual_seed`` makes runs repeat) and drawn
again in backward. Autograd on PEFT's module saves ``x`` and ``xd`` and runs eight kernels each
way; here the forward is a cast of the factors (none when they are in the compute dtype), the
shrink, the expand, and the base GEMM added into it; the backward ``u``, ``dx = u A`` with
``dy W`` added into it, then ``dA`` and ``dB`` while that GEMM runs
(:mod:`shuttle.train.products`).
"""

from __future__ import annotations

from typing import Any

import torch

from shuttle.train.frozen import FrozenLinear, check_frozen, check_unchanged, versions
from shuttle.train.products import (
    adapted_product,
    as_rows,
    compute_factors,
    grad_mm,
    like_rows,
    scaled_mm,
    shrink,
)

__all__ = ["LoRALinearFunction", "lora_linear"]


def _mask(like: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Dropout's mask for ``like``'s shape: 0 or ``1 / (1 - p)``, the same for the same seed."""
    g = torch.Generator(device=like.device).manual_seed(seed)
    keep = torch.empty(like.shape, dtype=torch.bool, device=like.device)
    return keep.bernoulli_(1 - p, generator=g).to(like.dtype).div_(1 - p)


class LoRALinearFunction(torch.autograd.Function):
    """``y = x W^T + b + scale * dropout(x) A^T B^T`` (see the module docs for the math)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, base: FrozenLinear, a: torch.Tensor,
                b: torch.Tensor, scale: float, dropout: float) -> torch.Tensor:
        dtype = x.dtype
        x2 = as_rows(x)
        a_, (b_,) = compute_factors(dtype, [a], [b])
        xd = x2
        seed = None
        if dropout > 0:
            seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
            xd = x2 * _mask(x2, dropout, seed)
        h = shrink(xd, a_)
        y = adapted_product(x2, base, h, b_, scale)  # the base GEMM last
        ctx.base, ctx.scale, ctx.dropout, ctx.seed = base, scale, dropout, seed
        ctx.param_dtypes = (a.dtype, b.dtype)
        ctx.versions = versions((base,))
        ctx.save_for_backward(xd, h, a_, b_, base.data)
        return like_rows(y, x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        check_unchanged("lora_linear", (ctx.base,), ctx.versions)
        xd, h, a_, b_, data = ctx.saved_tensors
        dy2 = as_rows(dy)
        grad_a = grad_b = dx = None
        u = scaled_mm(dy2, b_, ctx.scale)
        if ctx.needs_input_grad[0]:  # dx = mask * (u A) + dy W, the GEMM queued before dA, dB
            dx = u @ a_
            if ctx.seed is not None:
                dx.mul_(_mask(xd, ctx.dropout, ctx.seed))
            w = ctx.base.with_data(data).weight(dy.dtype)
            dx = like_rows(dx.addmm_(dy2, w), dy)
            del w
        if ctx.needs_input_grad[2]:
            grad_a = grad_mm(u.T, xd, 1.0, ctx.param_dtypes[0])
        if ctx.needs_input_grad[3]:
            grad_b = grad_mm(dy2.T, h, ctx.scale, ctx.param_dtypes[1])
        return dx, None, grad_a, grad_b, None, None, None


def lora_linear(x: torch.Tensor, base: FrozenLinear, a: torch.Tensor, b: torch.Tensor,
                scale: float, dropout: float = 0.0) -> torch.Tensor:
    """``x W^T + bias + scale * dropout(x) A^T B^T`` with the hand-derived backward.

    Args:
        x: ``(..., K)`` in the compute dtype.
        base: the frozen base (:func:`~shuttle.train.frozen.frozen_linear`).
        a: ``(r, K)`` (PEFT's ``lora_A.weight``); b: ``(N, r)`` (``lora_B.weight``); any float
            dtype (gradients come back in it; products run in ``x``'s dtype).
        scale: the LoRA scale (``alpha / r``, or PEFT's ``scaling``).
        dropout: LoRA dropout probability on the adapter's input (0 outside training).

    Raises:
        UnsupportedBaseError: ``base`` is not a FrozenLinear (an ``nn.Linear`` as it is).
        TrainingError: in backward, the base weight was changed in place since the forward.
    """
    check_frozen("lora_linear", base)
    return LoRALinearFunction.apply(x, base, a, b, scale, dropout)
