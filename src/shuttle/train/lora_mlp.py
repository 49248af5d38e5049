"""A gated MLP whose three projections carry LoRA, with one hand-derived backward.

    e = x G^T + sg (x Ag^T) Bg^T           gate   (T, F)
    g = x U^T + su (x Au^T) Bu^T           up     (T, F)
    h = act(e) * g                                (T, F)   shuttle.kernels.gated
    y = h D^T + sd (h Ad^T) Bd^T           down   (T, N)

(biases added where the base layers have them). Backward, for ``dy`` (T, N):

    ud = sd * dy Bd                (T, r)       dAd = ud^T h        dBd = sd * dy^T (h Ad^T)
    dh = dy D + ud Ad              (T, F)
    h, de, dg = gated_backward(dh, e, g)        one pass, written over dh, e and g
    ug = sg * de Bg, uu = su * dg Bu            dAg = ug^T x        dBg = sg * de^T (x Ag^T)
                                                dAu = uu^T x        dBu = su * dg^T (x Au^T)
    dx = de G + dg U + [ug uu] [Ag; Au]

Saved: ``x``, ``e``, ``g`` and the rank-sized products ``x [Ag; Au]^T`` and ``h Ad^T``; ``h`` is
recomputed by the backward's activation pass, which reads ``e`` and ``g`` anyway. The frozen
MLP under autograd saves ``e``, ``act(e)`` and ``g``, so this saves no more than the base alone
(``x`` for the adapters' gradients replaces ``act(e)``). A projection without an adapter passes
``a = b = None``; dropout is not taken here (the per-layer :mod:`shuttle.train.lora_linear` does).
Both ways, each output starts from the adapters' rank-sized products and the base GEMM is
accumulated into it (:mod:`shuttle.train.products`).
"""

from __future__ import annotations

from typing import Any

import torch

from shuttle.kernels.gated import Activation, gated_backward, gated_forward
from shuttle.train.frozen import FrozenLinear, check_frozen, check_unchanged, versions
from shuttle.train.products import (
    adapted_product,
    as_rows,
    base_product,
    compute_factors,
    grad_mm,
    like_rows,
    scaled_mm,
    shrink,
)

__all__ = ["LoRAMLPFunction", "lora_mlp"]


class LoRAMLPFunction(torch.autograd.Function):
    """``down(act(gate(x)) * up(x))`` with LoRA on each projection (module docs: the math)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, act: Activation,
                gate: FrozenLinear, ag: torch.Tensor | None, bg: torch.Tensor | None, sg: float,
                up: FrozenLinear, au: torch.Tensor | None, bu: torch.Tensor | None, su: float,
                down: FrozenLinear, ad: torch.Tensor | None, bd: torch.Tensor | None, sd: float
                ) -> torch.Tensor:
        dt = x.dtype
        x2 = as_rows(x)
        rg = 0 if ag is None else ag.shape[0]
        stacked = [a for a in (ag, au) if a is not None]  # rows of one (rg + ru, K) matrix
        others = [t for t in (bg, bu, ad, bd) if t is not None]
        a_in = hx = None
        cast: dict[int, torch.Tensor] = {}  # id(factor) -> the factor in the compute dtype
        if stacked or others:
            a_in, outs = compute_factors(dt, stacked, others)
            cast = {id(t): c for t, c in zip(others, outs, strict=True)}
        if a_in is not None:
            hx = shrink(x2, a_in)  # (T, rg + ru): one read of x
        e = base_product(x2, gate) if ag is None else \
            adapted_product(x2, gate, hx[:, :rg], cast[id(bg)], sg)
        g = base_product(x2, up) if au is None else \
            adapted_product(x2, up, hx[:, rg:], cast[id(bu)], su)
        h = gated_forward(e, g, act)
        hd = ad_ = bd_ = None
        if ad is None:
            y = base_product(h, down)
        else:
            ad_, bd_ = cast[id(ad)], cast[id(bd)]
            hd = shrink(h, ad_)
            y = adapted_product(h, down, hd, bd_, sd)
        del h
        ctx.act, ctx.bases, ctx.scales, ctx.rg = act, (gate, up, down), (sg, su, sd), rg
        ctx.versions = versions(ctx.bases)
        ctx.param_dtypes = [None if t is None else t.dtype for t in (ag, bg, au, bu, ad, bd)]
        ctx.save_for_backward(x2, e, g, hx, hd, a_in, cast.get(id(bg)), cast.get(id(bu)), ad_,
                              bd_, gate.data, up.data, down.data)
        return like_rows(y, x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        check_unchanged("lora_mlp", ctx.bases, ctx.versions)
        (x2, e, g, hx, hd, a_in, bg_, bu_, ad_, bd_, wg_data, wu_data, wd_data
         ) = ctx.saved_tensors
        gate, up, down = ctx.bases
        sg, su, sd = ctx.scales
        dtag, dtbg, dtau, dtbu, dtad, dtbd = ctx.param_dtypes
        need = ctx.needs_input_grad
        dy2 = as_rows(dy)

        wd = down.with_data(wd_data).weight(dy.dtype)
        grad_ad = grad_bd = ud = None
        if ad_ is None:
            dh = dy2 @ wd
        else:
            ud = scaled_mm(dy2, bd_, sd)
            dh = (ud @ ad_).addmm_(dy2, wd)
            if need[12]:
                grad_bd = grad_mm(dy2.T, hd, sd, dtbd)
        del wd
        # e and g are ours (saved by this function alone): overwritten with de and dg
        h, de, dg = gated_backward(dh, e, g, ctx.act, in_place=True)
        if ud is not None and need[11]:
            grad_ad = grad_mm(ud.T, h, 1.0, dtad)
        del h, dh

        # gate and up: u = s * d B side by side, dA = u^T x, dB = s * d^T (x A^T)
        rg = ctx.rg
        grads: dict[int, torch.Tensor] = {}  # argument position -> gradient
        u_all = None
        if a_in is not None:
            u_all = dy.new_empty(x2.shape[0], a_in.shape[0])
            if bg_ is not None:
                scaled_mm(de, bg_, sg, out=u_all[:, :rg])
                if need[4]:
                    grads[4] = grad_mm(de.T, hx[:, :rg], sg, dtbg)
            if bu_ is not None:
                scaled_mm(dg, bu_, su, out=u_all[:, rg:])
                if need[8]:
                    grads[8] = grad_mm(dg.T, hx[:, rg:], su, dtbu)
            wanted = [(at, dt_) for at, dt_, b in ((3, dtag, bg_), (7, dtau, bu_))
                      if b is not None and need[at]]
            if wanted:
                one = len({dt_ for _, dt_ in wanted}) == 1
                grad_a = grad_mm(u_all.T, x2, 1.0, wanted[0][1] if one else dy.dtype)
                rows = {3: slice(0, rg), 7: slice(rg, None)}
                for at, dt_ in wanted:
                    grads[at] = grad_a[rows[at]].to(dt_)
        dx = None
        if need[0]:
            wg = gate.with_data(wg_data).weight(dy.dtype)
            dx = de @ wg if u_all is None else (u_all @ a_in).addmm_(de, wg)
            del wg
            wu = up.with_data(wu_data).weight(dy.dtype)
            dx.addmm_(dg, wu)
            del wu
            dx = like_rows(dx, dy)
        return (dx, None, None, grads.get(3), grads.get(4), None, None, grads.get(7),
                grads.get(8), None, None, grad_ad, grad_bd, None)


def lora_mlp(x: torch.Tensor, act: Activation,
             gate: tuple[FrozenLinear, torch.Tensor | None, torch.Tensor | None, float],
             up: tuple[FrozenLinear, torch.Tensor | None, torch.Tensor | None, float],
             down: tuple[FrozenLinear, torch.Tensor | None, torch.Tensor | None, float]
             ) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))``, each projection ``(base, A, B, scale)`` (A and B None
    for a projection without an adapter), with the hand-derived backward.

    ``act``: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` or ``"gelu"`` (GeGLU).

    Raises:
        UnsupportedBaseError: a base is not a FrozenLinear (an ``nn.Linear`` as it is).
        TrainingError: in backward, a base weight was changed in place since the forward.
    """
    check_frozen("lora_mlp", gate[0], up[0], down[0])
    return LoRAMLPFunction.apply(x, act, *gate, *up, *down)
