"""The LoRA shrink: the rank-wide intermediate of an unmerged LoRA linear, rounded once.

For activations x (T, K), an adapter's down factor A (R, K) and per-rank scales ``scale`` (R,)
(strength x alpha / rank, repeated over each adapter's ranks; several adapters can be
concatenated along the rank)::

    S = (x @ A.T) * scale                    # lora_shrink: (T, R), rounded once

:func:`lora_shrink` accumulates the product in float32, multiplies it by ``scale`` in float32 and
rounds once; :func:`shuttle.kernels.lora_linear.lora_linear_fused` then adds ``S @ B.T`` to the
base GEMM. The scale is applied to the rank-wide S, not to the wide output. Where the (T, R)
tiles alone cannot fill the SMs, programs split K: float32 partial sums, reduced, scaled and
rounded on the host. For T > 64 on Hopper the shrink runs on the TMA kernel of
:mod:`shuttle.kernels.lora_linear_tma` (the ranks as output columns, ``scale`` as column scale),
except for short inputs (:func:`short_shrink`: at most 8192 rows of at most 4096 features), where
this module's kernel with :data:`SHRINK_SHORT_CONFIG` runs: x is a few MB there, and the
persistent TMA kernel's start (its descriptors made on the device) is a large share of the call.

Numerics and the fallback to :func:`lora_shrink_reference`: as for every LoRA linear kernel
(:mod:`shuttle.kernels.lora_launch`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from shuttle.kernels.launch import (
    cdiv,
    dependent_launch,
    interpreting,
    next_power_of_2,
    on_device_of,
    sm_count,
)
from shuttle.kernels.lora_launch import (
    SMALL_T,
    acc_dtype,
    fit_step,
    ieee_dot,
    unit_stride,
    use_kernel,
)
from shuttle.kernels.lora_linear_tma import SHRINK_TMA_CONFIG, linear_tma, tma_dtypes
from shuttle.kernels.tma import tma_addressable

__all__ = ["SHORT_SHRINK_K", "SHORT_SHRINK_ROWS", "SHRINK_CUDA_CONFIG", "SHRINK_SHORT_CONFIG",
           "ShrinkConfig", "launch_short_shrink", "lora_shrink", "lora_shrink_reference",
           "short_shrink"]


class ShrinkConfig(NamedTuple):
    """Launch parameters of the shrink kernel (a plain tuple in this order works too)."""

    block_t: int  # rows of x per program
    block_r: int  # most ranks per program (R is padded to a power of two >= 16, up to this)
    block_k: int  # reduction step
    num_warps: int
    num_stages: int
    split_k: int  # programs sharing one K range; 0 picks it from the grid size and SM count


# Default for sm_90 (132 SMs, 227 KiB shared memory per block).
# The shrink reads x once and is memory-bound (its output has only R columns); split-K (float32
# partial sums reduced on the host) engages when the (T, R) tiles alone cannot fill the SMs.
SHRINK_CUDA_CONFIG = ShrinkConfig(64, 128, 64, 4, 4, 0)
# Under the interpreter: small blocks so that test shapes span several tiles and rank steps.
_SHRINK_INTERPRET_CONFIG = ShrinkConfig(16, 16, 16, 1, 1, 1)
# Where x is short and narrow (short_shrink) on Hopper, in place of the TMA kernel: a call there
# reads a few MB, and the persistent TMA kernel's start (its descriptors made on the device) is
# a large share of it; past 4096 features the TMA kernel's deeper pipeline wins
# (docs/benchmarks.md, the dynamic LoRA section).
SHRINK_SHORT_CONFIG = ShrinkConfig(64, 128, 128, 4, 3, 1)
SHORT_SHRINK_ROWS = 8192
SHORT_SHRINK_K = 4096


def short_shrink(t: int, k: int) -> bool:
    """Whether x (t, k) takes :data:`SHRINK_SHORT_CONFIG` instead of the TMA kernel."""
    return t <= SHORT_SHRINK_ROWS and k <= SHORT_SHRINK_K


# ----------------------------------------------------------------------------------------------
# References (also the fallback)


def _shrink_out_dtype(x: torch.Tensor, down: torch.Tensor) -> torch.dtype:
    """x.dtype when the factor has x's dtype, else float32 (or float64 for float64 inputs)."""
    return x.dtype if down.dtype == x.dtype else acc_dtype(x, down)


def lora_shrink_reference(x: torch.Tensor, down: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(x @ down.T) * scale`` accumulated in float32 and rounded once; see :func:`lora_shrink`."""
    acc = acc_dtype(x, down)
    s = torch.matmul(x.to(acc), down.to(acc).T)
    s.mul_(scale.to(acc))
    return s.to(_shrink_out_dtype(x, down))


# ----------------------------------------------------------------------------------------------
# Kernels


# Shared tile helpers, bound by tiles.bind_tiles() when the kernel is built (see there).
dot_over_k = release_dependents = store_rne = None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    from shuttle.kernels.tiles import bind_tiles

    bind_tiles(globals(), "dot_over_k", "release_dependents", "store_rne")

    @triton.jit
    def shrink_kernel(x_ptr, d_ptr, scale_ptr, o_ptr, T, R, K, K_PER_SPLIT, stride_xt,
                      stride_dr, stride_ot, stride_os,
                      BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                      SPLIT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                      PDL: tl.constexpr):
        # One (BT, BR) tile of S over the K range [pid_k * K_PER_SPLIT, ... + K_PER_SPLIT).
        # With SPLIT > 1 the float32 partial sums go to a workspace (SPLIT, T, R) that the host
        # reduces, scales and rounds; with SPLIT == 1 the tile is scaled and rounded here.
        # PDL: a GEMM launched as this kernel's programmatic dependent may start now (it waits
        # for this kernel's end before reading S; a kernel launched the ordinary way waits
        # for it all the same).
        if PDL:
            release_dependents()
        pid_t = tl.program_id(0)
        pid_r = tl.program_id(1)
        pid_k = tl.program_id(2)
        rt = pid_t * BT + tl.arange(0, BT)
        rr = pid_r * BR + tl.arange(0, BR)
        # Out-of-range rows and ranks load a valid row again (wrapped) instead of being masked;
        # the store below masks them out.
        rt_l = (rt % T).to(tl.int64)
        rr_l = (rr % R).to(tl.int64)
        k0 = pid_k * K_PER_SPLIT
        rk = tl.arange(0, BK)
        x_ptrs = x_ptr + rt_l[:, None] * stride_xt + (k0 + rk)[None, :]
        d_ptrs = d_ptr + rr_l[None, :] * stride_dr + (k0 + rk)[:, None]
        acc = tl.zeros((BT, BR), dtype=tl.float32)
        k_end = tl.minimum(K - k0, K_PER_SPLIT)
        acc = dot_over_k(acc, x_ptrs, d_ptrs, rk, k_end, BK, EVEN_K, IEEE)
        mask = (rt[:, None] < T) & (rr[None, :] < R)
        o_ptrs = (o_ptr + pid_k * stride_os + rt.to(tl.int64)[:, None] * stride_ot
                  + rr[None, :])
        if SPLIT > 1:
            tl.store(o_ptrs, acc, mask=mask)
        else:
            store_rne(o_ptrs, acc * tl.load(scale_ptr + rr_l)[None, :], mask)

    return shrink_kernel


# ----------------------------------------------------------------------------------------------
# Dispatch


def lora_shrink(x: torch.Tensor, down: torch.Tensor, scale: torch.Tensor,
                config: tuple[int, int, int, int, int, int] | None = None,
                tma: bool | None = None) -> torch.Tensor:
    """``S = (x @ down.T) * scale``: the rank-wide LoRA intermediate, rounded once.

    Args:
        x: (T, K) activations, bf16/fp16/fp32.
        down: (R, K) down factor(s), of x's dtype or float32.
        scale: (R,) per-rank scale (float32), e.g. strength x alpha / rank for each adapter's ranks.
        config: a :class:`ShrinkConfig` (or the same 6-tuple) to override
            :data:`SHRINK_CUDA_CONFIG` (:data:`SHRINK_SHORT_CONFIG` for a short input on
            Hopper, or the small interpreter blocks).
        tma: use the Hopper TMA kernel
            (:data:`~shuttle.kernels.lora_linear_tma.SHRINK_TMA_CONFIG`); default: where it
            applies (see :func:`~shuttle.kernels.lora_linear.lora_linear_fused`), R is a
            multiple of 8 and x is not short (:func:`short_shrink`).

    Returns:
        (T, R) in x's dtype when ``down`` has x's dtype, else float32 (a float32 adapter on bf16
        activations keeps float32 math: x is upcast in the kernel and the dot is IEEE float32).
        The product is accumulated in float32, multiplied by ``scale`` in float32, rounded once.

    Uses the Triton kernel where Triton is installed and the tensors are on CUDA (or under
    ``TRITON_INTERPRET=1``), else :func:`lora_shrink_reference`.
    """
    if x.dim() != 2 or down.dim() != 2 or down.shape[1] != x.shape[1]:
        raise ValueError(f"lora_shrink: x (T, K) and down (R, K) expected, "
                         f"got {tuple(x.shape)} and {tuple(down.shape)}")
    t, k = x.shape
    r = down.shape[0]
    if scale.shape != (r,):
        raise ValueError(f"lora_shrink: scale of shape ({r},) expected, got {tuple(scale.shape)}")
    interpret = interpreting()  # read once: an environment lookup costs microseconds
    if t == 0 or r == 0 or not use_kernel(interpret, x, down, scale):
        return lora_shrink_reference(x, down, scale)

    x, down = unit_stride(x), unit_stride(down)
    scale = scale.to(torch.float32).contiguous()
    out_dtype = _shrink_out_dtype(x, down)
    hopper = (not interpret and t > SMALL_T and tma_dtypes(x, down) and tma_addressable(x, down)
              and r % 8 == 0)
    if tma or (tma is None and hopper and not short_shrink(t, k)):
        out = torch.empty(t, r, dtype=out_dtype, device=x.device)
        linear_tma(x, down, None, None, None, scale, out, SHRINK_TMA_CONFIG)
        return out
    if config is None:
        config = (_SHRINK_INTERPRET_CONFIG if interpret else
                  SHRINK_SHORT_CONFIG if hopper and tma is None else SHRINK_CUDA_CONFIG)
    cfg = ShrinkConfig(*config)
    bt = cfg.block_t
    br = min(max(16, cfg.block_r), max(16, next_power_of_2(r)))
    bk = fit_step(cfg.block_k, bt, br, x.element_size(), down.element_size(), cfg.num_stages)
    tiles = cdiv(t, bt) * cdiv(r, br)
    k_blocks = max(1, cdiv(k, bk))
    split = cfg.split_k
    if split <= 0:  # about two programs per SM, each with at least 4 K steps
        sms = sm_count(x.device.index) if x.is_cuda else 1
        split = 1 if tiles >= sms else max(1, min(cdiv(2 * sms, tiles), k_blocks // 4))
    per_split = cdiv(k_blocks, min(split, k_blocks))
    split = cdiv(k_blocks, per_split)  # no empty splits
    if split > 1:
        out = torch.empty(split, t, r, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(1, t, r, dtype=out_dtype, device=x.device)
    _launch(x, down, scale, out, cfg, br, bk, per_split * bk, interpret)
    if split > 1:
        return out.sum(0).mul_(scale).to(out_dtype)
    return out[0]


def launch_short_shrink(x: torch.Tensor, down: torch.Tensor, scale: torch.Tensor,
                        out: torch.Tensor) -> None:
    """Write ``(x @ down.T) * scale`` into ``out`` (T, R) by :data:`SHRINK_SHORT_CONFIG`, as
    :func:`lora_shrink` does for a :func:`short_shrink` input (bit for bit), on operands the
    caller checked: contiguous 16-bit x and ``down`` of one dtype, a float32 ``scale``.
    """
    cfg = SHRINK_SHORT_CONFIG
    k, r = x.shape[1], down.shape[0]
    br = min(max(16, cfg.block_r), max(16, next_power_of_2(r)))
    bk = fit_step(cfg.block_k, cfg.block_t, br, x.element_size(), down.element_size(),
                  cfg.num_stages)
    # CPU tensors run only in the interpreter (its float32 dots for 16-bit operands)
    _launch(x, down, scale, out.unsqueeze(0), cfg, br, bk, max(1, cdiv(k, bk)) * bk,
            not x.is_cuda)


def _launch(x: torch.Tensor, down: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
            cfg: ShrinkConfig, br: int, bk: int, k_per_split: int, interpret: bool) -> None:
    """The kernel over ``out`` (splits, T, R): ``k_per_split`` features per split."""
    t, k = x.shape
    r = down.shape[0]
    with on_device_of(x):
        _kernel()[(cdiv(t, cfg.block_t), cdiv(r, br), out.shape[0])](
            x, down, scale, out, t, r, k, k_per_split, x.stride(0), down.stride(0),
            out.stride(1), out.stride(0),
            BT=cfg.block_t, BR=br, BK=bk, SPLIT=out.shape[0],
            IEEE=ieee_dot(x.dtype, down.dtype, interpret), EVEN_K=k % bk == 0,
            PDL=x.is_cuda and dependent_launch(x.get_device()),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
