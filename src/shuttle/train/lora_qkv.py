"""Projections that share one input (attention's q, k and v), each with LoRA, in one function.

For projections ``i`` (q, k, v) of one ``x`` (T, K): ``y_i = x W_i^T + b_i + s_i (x A_i^T) B_i^T``.
The adapters' shrinks read ``x`` once (``hx = x [A_q; A_k; A_v]^T``, (T, sum r_i)), and ``x`` is
saved once for all of them. Backward, for ``dy_i``:

    u_i  = s_i * dy_i B_i               (T, r_i)
    dA   = [u_q u_k u_v]^T x            (sum r_i, K): one GEMM, split into dA_q, dA_k, dA_v
    dB_i = s_i * dy_i^T hx_i            (N_i, r_i)
    dx   = sum_i dy_i W_i + [u_q u_k u_v] [A_q; A_k; A_v]

A projection without an adapter passes ``a = b = None``; an output whose gradient autograd does
not supply (unused) counts as zero.
"""

from __future__ import annotations

from typing import Any

import torch

from shuttle.train.frozen import FrozenLinear

__all__ = ["LoRAProjectionsFunction", "lora_projections"]

Projection = tuple[FrozenLinear, torch.Tensor | None, torch.Tensor | None, float]


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class LoRAProjectionsFunction(torch.autograd.Function):
    """``[x W_i^T + b_i + s_i x A_i^T B_i^T for each i]`` (module docs: the math).

    Arguments after ``x``: ``n``, then per projection ``base, a, b, scale``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int, *specs: Any) -> tuple[torch.Tensor, ...]:
        dt = x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        projs = [specs[4 * i:4 * i + 4] for i in range(n)]
        with_lora = [i for i, (_, a, _, _) in enumerate(projs) if a is not None]
        ranks = [projs[i][1].shape[0] for i in with_lora]
        hx = None
        if with_lora:
            a_in = torch.cat([_as(projs[i][1], dt) for i in with_lora])
            hx = x2 @ a_in.T  # (T, sum r): one read of x
        outs = []
        start = 0
        for base, a, b, s in projs:
            w = base.weight(dt)
            y = torch.addmm(_as(base.bias, dt), x2, w.T) if base.bias is not None \
                else x2 @ w.T
            del w
            if a is not None:
                r = a.shape[0]
                y.addmm_(hx[:, start:start + r], _as(b, dt).T, alpha=s)
                start += r
            outs.append(y.view(*x.shape[:-1], y.shape[-1]))
        ctx.projs = [(base, s) for base, _, _, s in projs]
        ctx.with_lora, ctx.ranks, ctx.n = with_lora, ranks, n
        factors = [t for _, a, b, _ in projs for t in (a, b)]
        ctx.save_for_backward(x2, hx, *factors, *(base.data for base, _, _, _ in projs))
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *dys: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        n = ctx.n
        saved = ctx.saved_tensors
        x2, hx = saved[0], saved[1]
        factors = saved[2:2 + 2 * n]
        datas = saved[2 + 2 * n:]
        need = ctx.needs_input_grad
        dt = next(d for d in dys if d is not None).dtype
        grads: list[torch.Tensor | None] = [None] * (4 * n)
        dx = None
        us, a_rows = [], []
        start = 0
        for i in range(n):
            base, s = ctx.projs[i]
            a, b = factors[2 * i], factors[2 * i + 1]
            dy = dys[i]
            r = 0 if a is None else a.shape[0]
            if dy is None:  # an output nobody used: zero gradient
                if a is not None:
                    us.append(x2.new_zeros(x2.shape[0], r))
                    a_rows.append(_as(a, dt))
                    start += r
                continue
            dy2 = dy.reshape(-1, dy.shape[-1])
            if need[0]:
                w = base.with_data(datas[i]).weight(dt)
                dx = dy2 @ w if dx is None else dx.addmm_(dy2, w)
                del w
            if a is not None:
                u = dy2 @ _as(b, dt)
                u.mul_(s)
                us.append(u)
                a_rows.append(_as(a, dt))
                if need[2 + 4 * i + 2]:
                    grads[4 * i + 2] = _as((dy2.T @ hx[:, start:start + r]).mul_(s), b.dtype)
                start += r
        if us:
            u_all = torch.cat(us, dim=1) if len(us) > 1 else us[0]
            if any(need[2 + 4 * i + 1] for i in ctx.with_lora):
                grad_a = u_all.T @ x2  # (sum r, K): every adapter's dA in one GEMM
                row = 0
                for i, r in zip(ctx.with_lora, ctx.ranks, strict=True):
                    grads[4 * i + 1] = _as(grad_a[row:row + r], factors[2 * i].dtype)
                    row += r
            if need[0]:
                a_all = torch.cat(a_rows) if len(a_rows) > 1 else a_rows[0]
                if dx is None:
                    dx = u_all @ a_all
                else:
                    dx.addmm_(u_all, a_all)
        if dx is not None:
            shape = next(d for d in dys if d is not None).shape[:-1]
            dx = dx.view(*shape, dx.shape[-1])
        return (dx, None, *grads)


def lora_projections(x: torch.Tensor, *projections: Projection) -> tuple[torch.Tensor, ...]:
    """``x W_i^T + b_i + s_i x A_i^T B_i^T`` for each ``(base, A, B, scale)`` in
    ``projections`` (A and B None without an adapter), with one read of ``x`` for the adapters'
    shrinks and one saved copy of it, and the hand-derived backward.
    """
    specs = [t for p in projections for t in p]
    return LoRAProjectionsFunction.apply(x, len(projections), *specs)
