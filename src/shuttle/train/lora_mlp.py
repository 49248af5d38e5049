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
"""

from __future__ import annotations

from typing import Any

import torch

from shuttle.kernels.gated import Activation, gated_backward, gated_forward
from shuttle.train.frozen import FrozenLinear

__all__ = ["LoRAMLPFunction", "lora_mlp"]


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _base(x2: torch.Tensor, base: FrozenLinear) -> torch.Tensor:
    w = base.weight(x2.dtype)
    if base.bias is not None:
        return torch.addmm(_as(base.bias, x2.dtype), x2, w.T)
    return x2 @ w.T


def _cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
    ts = tuple(t for t in ts if t is not None)
    return None if not ts else ts[0] if len(ts) == 1 else torch.cat(ts)


class LoRAMLPFunction(torch.autograd.Function):
    """``down(act(gate(x)) * up(x))`` with LoRA on each projection (module docs: the math)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, act: Activation,
                gate: FrozenLinear, ag: torch.Tensor | None, bg: torch.Tensor | None, sg: float,
                up: FrozenLinear, au: torch.Tensor | None, bu: torch.Tensor | None, su: float,
                down: FrozenLinear, ad: torch.Tensor | None, bd: torch.Tensor | None, sd: float
                ) -> torch.Tensor:
        dt = x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        e = _base(x2, gate)
        g = _base(x2, up)
        rg = 0 if ag is None else ag.shape[0]
        a_in = _cat(*(None if a is None else _as(a, dt) for a in (ag, au)))
        hx = None if a_in is None else x2 @ a_in.T  # (T, rg + ru): one read of x
        if ag is not None:
            e.addmm_(hx[:, :rg], _as(bg, dt).T, alpha=sg)
        if au is not None:
            g.addmm_(hx[:, rg:], _as(bu, dt).T, alpha=su)
        h = gated_forward(e, g, act)
        y = _base(h, down)
        hd = None
        if ad is not None:
            hd = h @ _as(ad, dt).T
            y.addmm_(hd, _as(bd, dt).T, alpha=sd)
        del h
        ctx.act, ctx.bases, ctx.scales, ctx.rg = act, (gate, up, down), (sg, su, sd), rg
        ctx.save_for_backward(x2, e, g, hx, hd, ag, bg, au, bu, ad, bd,
                              gate.data, up.data, down.data)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x2, e, g, hx, hd, ag, bg, au, bu, ad, bd, wg_data, wu_data, wd_data) = ctx.saved_tensors
        gate, up, down = ctx.bases
        sg, su, sd = ctx.scales
        dt = dy.dtype
        need = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])

        wd = down.with_data(wd_data).weight(dt)
        dh = dy2 @ wd
        del wd
        grad_ad = grad_bd = None
        if ad is not None:
            ud = dy2 @ _as(bd, dt)
            ud.mul_(sd)
            dh.addmm_(ud, _as(ad, dt))
            if need[12]:
                grad_bd = _as((dy2.T @ hd).mul_(sd), bd.dtype)
        # e and g are ours (saved by this function alone): overwritten with de and dg
        h, de, dg = gated_backward(dh, e, g, ctx.act, in_place=True)
        if ad is not None and need[11]:
            grad_ad = _as(ud.T @ h, ad.dtype)
        del h, dh

        # gate and up: u = s * d B, dA = u^T x, dB = s * d^T (x A^T); d is de or dg
        grads: dict[int, torch.Tensor] = {}  # argument position -> gradient
        us = []
        rg = ctx.rg
        for a, b, s, d, cols, at in ((ag, bg, sg, de, slice(0, rg), 3),
                                     (au, bu, su, dg, slice(rg, None), 7)):
            if a is None:
                continue
            u = d @ _as(b, dt)
            u.mul_(s)
            us.append(u)
            if need[at]:
                grads[at] = _as(u.T @ x2, a.dtype)
            if need[at + 1]:
                grads[at + 1] = _as((d.T @ hx[:, cols]).mul_(s), b.dtype)
        dx = None
        if need[0]:
            wg = gate.with_data(wg_data).weight(dt)
            dx = de @ wg
            del wg
            wu = up.with_data(wu_data).weight(dt)
            dx.addmm_(dg, wu)
            del wu
            if us:
                a_in = _cat(*(None if a is None else _as(a, dt) for a in (ag, au)))
                dx.addmm_(torch.cat(us, dim=1) if len(us) > 1 else us[0], a_in)
            dx = dx.view(*dy.shape[:-1], dx.shape[-1])
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
    """
    return LoRAMLPFunction.apply(x, act, *gate, *up, *down)
