"""Unmerged LoRA linear as one GEMM that also adds the update: ``x @ W.T + S @ B.T + bias``.

For activations x (T, K), a base weight W (N, K) with optional bias (N,), and an adapter with
down factor A (R, K), up factor B (N, R) and per-rank scales ``scale`` (R,) (strength x alpha /
rank, repeated over each adapter's ranks; several adapters can be concatenated along the rank),
the layer output is::

    S   = (x @ A.T) * scale                  # lora_shrink: (T, R), rounded once
    out = x @ W.T + S @ B.T + bias            # lora_linear_fused: (T, N), rounded once

S comes from :func:`shuttle.kernels.lora_shrink.lora_shrink`; this module computes ``out``.

:func:`lora_linear_fused` keeps one float32 accumulator per output tile: it runs the base K loop
(x against W), then a second, short loop over the rank (S against B), adds the bias in its
epilogue and stores the tile once. The update is never materialised at (T, N) and never rounded
on its own, and the output is not read back: over the base GEMM the extra traffic is reading S
(T x R) and B (N x R), and the extra work 2·T·N·R FLOPs. The scale is applied to the rank-wide S,
not to the wide output. For T > 64 on Hopper the same sum runs on the TMA kernel of
:mod:`shuttle.kernels.lora_linear_tma`.

Numerics and the fallback to :func:`lora_linear_fused_reference`: as for every LoRA linear kernel
(:mod:`shuttle.kernels.lora_launch`).
"""

from __future__ import annotations

import functools

import torch

from shuttle.kernels.launch import (
    cdiv,
    interpreting,
    next_power_of_2,
    on_device_of,
    sm_count,
)
from shuttle.kernels.lora_launch import (
    SMALL_T,
    FusedConfig,
    acc_dtype,
    fit_step,
    ieee_dot,
    unit_stride,
    use_kernel,
)
from shuttle.kernels.lora_linear_tma import fused_tma_config, linear_tma, tma_dtypes
from shuttle.kernels.tma import tma_addressable

__all__ = [
    "FUSED_CUDA_CONFIG",
    "FUSED_CUDA_SMALL_T_CONFIG",
    "FusedConfig",
    "lora_linear_fused",
    "lora_linear_fused_reference",
]


# Defaults for sm_90 (132 SMs, 227 KiB shared memory per block). The fused kernel at T > 64 is
# a compute-bound GEMM: the Triton matmul tutorial's Hopper bf16 tile (128 x 256 x 64, 8 warps,
# 3 stages: 3 x (128 + 256) x 64 x 2 B = 144 KiB of staged tiles; the tile choice:
# docs/benchmarks/fused_breakdown.md). float32 operands get shorter K/rank steps so their staged
# tiles fit (fit_step). At T <= 64 (decode) the kernel is bound by reading W, so smaller column
# tiles give more programs.
FUSED_CUDA_CONFIG = FusedConfig(128, 256, 64, 64, 8, 8, 3)
FUSED_CUDA_SMALL_T_CONFIG = FusedConfig(0, 64, 128, 64, 1, 4, 4)
# Under the interpreter: small blocks so that test shapes span several tiles and rank steps.
_FUSED_INTERPRET_CONFIG = FusedConfig(16, 32, 16, 16, 2, 1, 1)


# ----------------------------------------------------------------------------------------------
# References (also the fallback)


def lora_linear_fused_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                s: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T + s @ up.T + bias`` in float32, rounded once to ``x.dtype``.

    Materialises float32 copies of the operands: a fallback and an oracle, not a fast path.
    """
    acc = acc_dtype(x, weight, s, up, bias)
    out = torch.matmul(x.to(acc), weight.to(acc).T)
    out.addmm_(s.to(acc), up.to(acc).T)
    if bias is not None:
        out.add_(bias.to(acc))
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Kernels


# Shared tile helpers, bound by tiles.bind_tiles() when the kernel is built (see there).
dot_over_k = store_rne = None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    from shuttle.kernels.tiles import bind_tiles

    bind_tiles(globals(), "dot_over_k", "store_rne")

    @triton.jit
    def fused_kernel(x_ptr, w_ptr, b_ptr, s_ptr, u_ptr, o_ptr, T, N, K, R,
                     stride_xt, stride_wn, stride_st, stride_un, stride_ot,
                     BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                     GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BASE_IEEE: tl.constexpr,
                     LORA_IEEE: tl.constexpr, EVEN_K: tl.constexpr):
        # Swizzled program order (the Triton matmul tutorial's): GROUP row tiles walk the column
        # tiles together, so a W tile is fetched into L2 once for GROUP programs running close
        # in time.
        pid = tl.program_id(0)
        grid_t = tl.cdiv(T, BT)
        grid_n = tl.cdiv(N, BN)
        in_group = GROUP * grid_n
        first_t = (pid // in_group) * GROUP
        group_t = tl.minimum(grid_t - first_t, GROUP)
        pid_t = first_t + (pid % in_group) % group_t
        pid_n = (pid % in_group) // group_t

        rt = pid_t * BT + tl.arange(0, BT)
        rn = pid_n * BN + tl.arange(0, BN)
        # Wrapped row/column indices: loads stay in bounds without row masks (only the K tail
        # is masked); the store masks the wrapped rows and columns out.
        rt_l = (rt % T).to(tl.int64)
        rn_l = (rn % N).to(tl.int64)
        acc = tl.zeros((BT, BN), dtype=tl.float32)

        # Base: acc = x @ W.T over K.
        rk = tl.arange(0, BK)
        x_ptrs = x_ptr + rt_l[:, None] * stride_xt + rk[None, :]
        w_ptrs = w_ptr + rn_l[None, :] * stride_wn + rk[:, None]
        acc = dot_over_k(acc, x_ptrs, w_ptrs, rk, K, BK, EVEN_K, BASE_IEEE)

        # LoRA update into the same accumulator: acc += S @ up.T over the rank.
        rr = tl.arange(0, BR)
        s_ptrs = s_ptr + rt_l[:, None] * stride_st + rr[None, :]
        u_ptrs = u_ptr + rn_l[None, :] * stride_un + rr[:, None]
        acc = dot_over_k(acc, s_ptrs, u_ptrs, rr, R, BR, False, LORA_IEEE)

        if HAS_BIAS:
            acc += tl.load(b_ptr + rn_l).to(tl.float32)[None, :]
        mask = (rt[:, None] < T) & (rn[None, :] < N)
        o_ptrs = o_ptr + rt.to(tl.int64)[:, None] * stride_ot + rn[None, :]
        store_rne(o_ptrs, acc, mask)

    return fused_kernel


# ----------------------------------------------------------------------------------------------
# Dispatch


def lora_linear_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      s: torch.Tensor, up: torch.Tensor,
                      config: tuple[int, int, int, int, int, int, int] | None = None,
                      tma: bool | None = None) -> torch.Tensor:
    """``out = x @ weight.T + s @ up.T + bias`` in one kernel, float32 accumulator, one rounding.

    Args:
        x: (T, K) activations, bf16/fp16/fp32.
        weight: (N, K) base weight, normally of x's dtype.
        bias: (N,) or None.
        s: (T, R) the scaled LoRA intermediate from
            :func:`~shuttle.kernels.lora_shrink.lora_shrink` (x's dtype or float32).
        up: (N, R) up factor(s), of s's dtype or float32. When ``s`` or ``up`` is float32 the
            rank part runs as an IEEE float32 dot; so does the base part for float32 operands.
        config: a :class:`FusedConfig` (or the same 7-tuple) to override
            :data:`FUSED_CUDA_CONFIG` / :data:`FUSED_CUDA_SMALL_T_CONFIG` (or the interpreter's).
        tma: use the Hopper kernel of :mod:`shuttle.kernels.lora_linear_tma` (TMA loads,
            persistent tiles; ``config``, else its :data:`FUSED_TMA_CONFIG`, or
            :data:`FUSED_TMA_NARROW_CONFIG` where the wide tiles fill the SMs' last round
            below :data:`FILL_FOR_WIDE_TILES`); default: for T > 64
            on CUDA devices of compute capability 9.0+, when all operands share one 16-bit
            dtype and are 16-byte aligned.

    Returns:
        (T, N) in x's dtype. R may be any size >= 1 (the rank loop is masked).

    Uses the Triton kernel where Triton is installed and the tensors are on CUDA (or under
    ``TRITON_INTERPRET=1``), else :func:`lora_linear_fused_reference`.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"lora_linear_fused: x (T, K) and weight (N, K) expected, "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    t, k = x.shape
    n = weight.shape[0]
    if s.dim() != 2 or up.dim() != 2 or s.shape[0] != t or up.shape != (n, s.shape[1]):
        raise ValueError(f"lora_linear_fused: s (T={t}, R) and up (N={n}, R) expected, "
                         f"got {tuple(s.shape)} and {tuple(up.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"lora_linear_fused: bias of shape ({n},) expected, "
                         f"got {tuple(bias.shape)}")
    r = s.shape[1]
    interpret = interpreting()
    if t == 0 or n == 0 or r == 0 or not use_kernel(interpret, x, weight, bias, s, up):
        return lora_linear_fused_reference(x, weight, bias, s, up)

    if tma or (tma is None and not interpret and t > SMALL_T and tma_dtypes(x, weight, s, up)
               and tma_addressable(x, weight, s, up) and n % 8 == 0):
        out = torch.empty(t, n, dtype=x.dtype, device=x.device)
        cfg = (FusedConfig(*config) if config
               else fused_tma_config(t, n, sm_count(x.device.index) if x.is_cuda else 1))
        linear_tma(x, weight, s, up, bias, None, out, cfg)
        return out
    if config is not None:
        cfg = FusedConfig(*config)
    elif interpret:
        cfg = _FUSED_INTERPRET_CONFIG
    else:
        cfg = FUSED_CUDA_SMALL_T_CONFIG if t <= SMALL_T else FUSED_CUDA_CONFIG
    bt = cfg.block_t or min(SMALL_T, max(16, next_power_of_2(t)))
    bn = cfg.block_n
    # float32 operands take twice the staged shared memory: shorter K/rank steps keep them fit.
    bk = fit_step(cfg.block_k, bt, bn, x.element_size(), weight.element_size(), cfg.num_stages)
    br = fit_step(min(max(16, cfg.block_r), max(16, next_power_of_2(r))), bt, bn,
                   s.element_size(), up.element_size(), cfg.num_stages)
    x, weight, s, up = unit_stride(x), unit_stride(weight), unit_stride(s), unit_stride(up)
    if bias is not None:
        bias = bias.contiguous()
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    grid = (cdiv(t, bt) * cdiv(n, bn),)
    with on_device_of(x):
        _kernel()[grid](
            x, weight, bias if bias is not None else out, s, up, out, t, n, k, r,
            x.stride(0), weight.stride(0), s.stride(0), up.stride(0), out.stride(0),
            BT=bt, BN=bn, BK=bk, BR=br, GROUP=max(1, cfg.group), HAS_BIAS=bias is not None,
            BASE_IEEE=ieee_dot(x.dtype, weight.dtype, interpret),
            LORA_IEEE=ieee_dot(s.dtype, up.dtype, interpret),
            EVEN_K=k % bk == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
