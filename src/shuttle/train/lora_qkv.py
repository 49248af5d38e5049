"""Projections that share one input (attention's q, k and v), each with LoRA, in one function.

For projections ``i`` (q, k, v) of one ``x`` (T, K): ``y_i = x W_i^T + b_i + s_i (x A_i^T) B_i^T``.
The adapters' shrinks read ``x`` once (``hx = x [A_q; A_k; A_v]^T``, (T, sum r_i)), and ``x`` is
saved once for all of them. Backward, for ``dy_i``:

    u_i  = s_i * dy_i B_i               (T, r_i), side by side in one (T, sum r_i) buffer
    dA   = [u_q u_k u_v]^T x            (sum r_i, K): one GEMM, split into dA_q, dA_k, dA_v
    dB_i = s_i * dy_i^T hx_i            (N_i, r_i)
    dx   = [u_q u_k u_v] [A_q; A_k; A_v] + sum_i dy_i W_i

Order of the products (:mod:`shuttle.train.products`). Forward: the base GEMMs of the
projections narrower than the widest (GQA's k and v; the first one where all are equally wide),
then the adapters' shrink and the other projections' expands with their base GEMMs accumulated
into them, the early ones' expands added last. Backward: ``u``, then ``dx = u A`` and the
first ``dy_i W_i`` into it, the adapters' gradients, the other ``dy_i W_i`` last. A projection
without an adapter passes ``a = b = None``; an output whose gradient autograd does not supply
(unused) counts as zero.
"""

from __future__ import annotations

from typing import Any

import torch

from shuttle.train.frozen import FrozenLinear, check_frozen, check_unchanged, versions
from shuttle.train.products import (
    add_base,
    as_dtype,
    as_rows,
    base_product,
    compute_factors,
    expand,
    grad_mm,
    like_rows,
    scaled_mm,
    shrink,
    split_columns,
)

__all__ = ["LoRAProjectionsFunction", "lora_projections"]

Projection = tuple[FrozenLinear, torch.Tensor | None, torch.Tensor | None, float]


class LoRAProjectionsFunction(torch.autograd.Function):
    """``[x W_i^T + b_i + s_i x A_i^T B_i^T for each i]`` (module docs: the math).

    Arguments after ``x``: ``n``, then per projection ``base, a, b, scale``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int, *specs: Any) -> tuple[torch.Tensor, ...]:
        dt = x.dtype
        x2 = as_rows(x)
        projs = [specs[4 * i:4 * i + 4] for i in range(n)]
        lora = [i for i in range(n) if projs[i][1] is not None]
        ranks = [projs[i][1].shape[0] for i in lora]  # the columns of hx (and of u) per adapter
        # base GEMMs before anything else, so that the GPU starts on large products at once
        # whatever the host still has to launch; their expands are added after them (an
        # ``addmm_`` rereads and rewrites the output), so they are the projections narrower than
        # the widest (GQA's k and v), or the first of equally wide ones
        widths = [projs[i][0].out_features for i in range(n)]
        early = [i for i in range(n) if widths[i] < max(widths)] or [0]
        ys: list[torch.Tensor | None] = [None] * n
        for i in early:
            ys[i] = base_product(x2, projs[i][0])
        a_all = hx = None
        bs: list[torch.Tensor] = []
        hs: tuple[torch.Tensor, ...] = ()
        if lora:
            a_all, bs = compute_factors(dt, [projs[i][1] for i in lora],
                                        [projs[i][2] for i in lora])
            hx = shrink(x2, a_all)  # (T, sum r): one read of x
            hs = split_columns(hx, ranks)
            for i, b, h in zip(lora, bs, hs, strict=True):
                if i not in early:
                    ys[i] = expand(h, b, projs[i][3], projs[i][0].bias)
        for i in range(n):
            if i not in early:
                y = ys[i]
                ys[i] = base_product(x2, projs[i][0]) if y is None else \
                    add_base(y, x2, projs[i][0])
        for i, b, h in zip(lora, bs, hs, strict=True):
            if i in early:
                ys[i].addmm_(h, b.T, alpha=projs[i][3])
        outs = tuple(like_rows(y, x) for y in ys)
        ctx.projs = [(base, s) for base, _, _, s in projs]
        ctx.versions = versions(tuple(base for base, _ in ctx.projs))
        ctx.lora, ctx.ranks, ctx.n = lora, ranks, n
        ctx.param_dtypes = {i: (projs[i][1].dtype, projs[i][2].dtype) for i in lora}
        ctx.save_for_backward(x2, hx, a_all, *bs, *(base.data for base, _, _, _ in projs))
        return outs

    @staticmethod
    def backward(ctx: Any, *dys: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        n, lora, ranks = ctx.n, ctx.lora, ctx.ranks
        check_unchanged("lora_projections", tuple(base for base, _ in ctx.projs), ctx.versions)
        saved = ctx.saved_tensors
        x2, hx, a_all = saved[:3]
        bs = saved[3:3 + len(lora)]
        datas = saved[3 + len(lora):]
        need = ctx.needs_input_grad
        dy0 = next(d for d in dys if d is not None)
        dt = dy0.dtype
        dy2 = [None if d is None else as_rows(d) for d in dys]
        grads: list[torch.Tensor | None] = [None] * (4 * n)
        u_all = None
        if lora:  # u side by side: one (T, sum r) buffer
            u_all = dy0.new_empty(x2.shape[0], hx.shape[1])
            for i, b, u in zip(lora, bs, split_columns(u_all, ranks), strict=True):
                if dy2[i] is None:  # an output nobody used: zero gradient
                    u.zero_()
                else:
                    scaled_mm(dy2[i], b, ctx.projs[i][1], out=u)
        # dx = u [A_q; A_k; A_v] + sum_i dy_i W_i: the first GEMM as soon as u is there, the
        # adapters' other products while it runs, the remaining GEMMs last
        rest = [i for i in range(n) if dy2[i] is not None]
        dx = None
        if need[0]:
            if u_all is not None:
                dx = u_all @ a_all
            i = rest.pop(0)
            w = ctx.projs[i][0].with_data(datas[i]).weight(dt)
            dx = dy2[i] @ w if dx is None else dx.addmm_(dy2[i], w)
            del w
        if lora:
            if any(need[3 + 4 * i] for i in lora):
                a_dtypes = {ctx.param_dtypes[i][0] for i in lora}
                grad_a = grad_mm(u_all.T, x2, 1.0, a_dtypes.pop() if len(a_dtypes) == 1 else dt)
                gs = (grad_a,) if len(lora) == 1 else grad_a.split_with_sizes(ranks)
                for i, g in zip(lora, gs, strict=True):
                    grads[4 * i + 1] = as_dtype(g, ctx.param_dtypes[i][0])
            for i, h in zip(lora, split_columns(hx, ranks), strict=True):
                if dy2[i] is not None and need[4 + 4 * i]:
                    grads[4 * i + 2] = grad_mm(dy2[i].T, h, ctx.projs[i][1],
                                               ctx.param_dtypes[i][1])
        if dx is not None:
            for i in rest:
                w = ctx.projs[i][0].with_data(datas[i]).weight(dt)
                dx.addmm_(dy2[i], w)
                del w
            dx = like_rows(dx, dy0)
        return (dx, None, *grads)


def lora_projections(x: torch.Tensor, *projections: Projection) -> tuple[torch.Tensor, ...]:
    """``x W_i^T + b_i + s_i x A_i^T B_i^T`` for each ``(base, A, B, scale)`` in
    ``projections`` (A and B None without an adapter), with one read of ``x`` for the adapters'
    shrinks and one saved copy of it, and the hand-derived backward.

    Raises:
        UnsupportedBaseError: a base is not a FrozenLinear (an ``nn.Linear`` as it is).
        TrainingError: in backward, a base weight was changed in place since the forward.
    """
    check_frozen("lora_projections", *(p[0] for p in projections))
    specs = [t for p in projections for t in p]
    return LoRAProjectionsFunction.apply(x, len(projections), *specs)
