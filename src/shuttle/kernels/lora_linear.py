"""Unmerged LoRA linear in two kernels: a rank-wide shrink, then one GEMM that also adds the update.

For an adapter with down factor A (R, K), up factor B (N, R) and per-rank scales ``scale`` (R,)
(strength x alpha / rank, repeated over each adapter's ranks; several adapters can be concatenated
along the rank), the layer output is::

    S   = (x @ A.T) * scale                  # lora_shrink: (T, R), rounded once
    out = x @ W.T + S @ B.T + bias            # lora_linear_fused: (T, N), rounded once

:func:`lora_linear_fused` keeps one float32 accumulator per output tile: it runs the base K loop
(x against W), then a second, short loop over the rank (S against B), adds the bias in its
epilogue and stores the tile once. The update is never materialised at (T, N) and never rounded
on its own, and the output is not read back: over the base GEMM the extra traffic is reading S
(T x R) and B (N x R), and the extra work 2·T·N·R FLOPs. The scale is applied to the rank-wide S,
not to the wide output.

Numerics: products of bf16/fp16 operands are exact in float32, so both kernels equal their
references (:func:`lora_shrink_reference`, :func:`lora_linear_fused_reference`) up to float32
summation order, which can move a rounded result by one ulp in rare cases. float32 factors keep
float32 math (an IEEE float32 dot; activations are upcast inside the kernel).

The references are plain PyTorch; they are the fallback where Triton is missing, the tensors are
on the CPU without ``TRITON_INTERPRET=1``, or autograd is recording (the kernels have no backward).
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import torch

from shuttle.kernels.launch import (
    CompiledLaunch,
    bind_tiles,
    cdiv,
    interpreting,
    next_power_of_2,
    on_device_of,
    sm_count,
    triton_available,
)
from shuttle.kernels.tma import ensure_allocator, tma_addressable

__all__ = [
    "FILL_FOR_WIDE_TILES",
    "FUSED_CUDA_CONFIG",
    "FUSED_CUDA_SMALL_T_CONFIG",
    "FUSED_TMA_CONFIG",
    "FUSED_TMA_NARROW_CONFIG",
    "SHRINK_TMA_CONFIG",
    "SHRINK_CUDA_CONFIG",
    "FusedConfig",
    "PreparedLoraLinear",
    "ShrinkConfig",
    "lora_linear_fused",
    "lora_linear_fused_reference",
    "lora_shrink",
    "lora_shrink_reference",
]

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ShrinkConfig(NamedTuple):
    """Launch parameters of the shrink kernel (a plain tuple in this order works too)."""

    block_t: int  # rows of x per program
    block_r: int  # most ranks per program (R is padded to a power of two >= 16, up to this)
    block_k: int  # reduction step
    num_warps: int
    num_stages: int
    split_k: int  # programs sharing one K range; 0 picks it from the grid size and SM count


class FusedConfig(NamedTuple):
    """Launch parameters of the fused kernel (a plain tuple in this order works too)."""

    block_t: int  # output rows per program; 0: the next power of two >= T, 16 to 64
    block_n: int  # output columns per program
    block_k: int  # base reduction step
    block_r: int  # most ranks per rank-loop step (>= 16)
    group: int  # row tiles per group in the swizzled program order (L2 reuse of W tiles)
    num_warps: int
    num_stages: int


# Defaults for sm_90 (132 SMs, 227 KiB shared memory per block). The fused kernel at T > 64 is
# a compute-bound GEMM: the Triton matmul tutorial's Hopper bf16 tile (128 x 256 x 64, 8 warps,
# 3 stages: 3 x (128 + 256) x 64 x 2 B = 144 KiB of staged tiles). At bf16 prefill shapes it
# beats 128 x 128 and 64 x 256 tiles; 4 stages and 32-rank steps make no measurable difference.
# float32 operands get shorter K/rank steps so their staged tiles fit (_fit_step). At T <= 64
# (decode) the kernel is bound by reading W, so smaller column tiles give more programs; decode
# timings were dominated by host overhead and are not settled.
FUSED_CUDA_CONFIG = FusedConfig(128, 256, 64, 64, 8, 8, 3)
FUSED_CUDA_SMALL_T_CONFIG = FusedConfig(0, 64, 128, 64, 1, 4, 4)
# The shrink reads x once and is memory-bound (its output has only R columns); split-K (float32
# partial sums reduced on the host) engages when the (T, R) tiles alone cannot fill the SMs.
SHRINK_CUDA_CONFIG = ShrinkConfig(64, 128, 64, 4, 4, 0)
# The Hopper (TMA, persistent) kernel for T > 64: at the Wan2.1, Z-Image and 8B-prefill shapes
# the 128 x 256 x 64 tile with 3 stages comes close to cuBLAS on the base GEMM alone and beats
# 128 x 128 tiles with the rank loop.
FUSED_TMA_CONFIG = FusedConfig(128, 256, 64, 64, 8, 8, 3)
# Where those tiles fill the SMs' last round poorly (below FILL_FOR_WIDE_TILES of the rounds'
# slots), 128 x 128 tiles with 128-wide K steps: at the demo DiT's 1536-wide layers and 4096
# rows (192 wide tiles on 132 SMs, 73% of two rounds) they are faster, and slower where the
# wide tiles fill their rounds (docs/benchmarks/fused_breakdown_waves.md).
FUSED_TMA_NARROW_CONFIG = FusedConfig(128, 128, 128, 64, 8, 8, 3)
FILL_FOR_WIDE_TILES = 0.8
# The shrink on the same kernel: output columns are the ranks (block_n is fitted to R). In the
# tile sweep (CUDA graphs), 64 x 128-wide K steps with 4 stages beat 128 x 64 steps at Z-Image
# attention and matched them at the Wan2.1 shapes; cuBLAS's skinny GEMM plus a scale kernel was
# slower at both.
SHRINK_TMA_CONFIG = FusedConfig(64, 128, 128, 64, 8, 4, 4)
# Under the interpreter: small blocks so that test shapes span several tiles and rank steps.
_FUSED_INTERPRET_CONFIG = FusedConfig(16, 32, 16, 16, 2, 1, 1)
_SHRINK_INTERPRET_CONFIG = ShrinkConfig(16, 16, 16, 1, 1, 1)
_SMALL_T = 64


# ----------------------------------------------------------------------------------------------
# References (also the fallback)


def _acc_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32, or float64 when an input is float64 (never less precise than the inputs)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _shrink_out_dtype(x: torch.Tensor, down: torch.Tensor) -> torch.dtype:
    """x.dtype when the factor has x's dtype, else float32 (or float64 for float64 inputs)."""
    return x.dtype if down.dtype == x.dtype else _acc_dtype(x, down)


def lora_shrink_reference(x: torch.Tensor, down: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(x @ down.T) * scale`` accumulated in float32 and rounded once; see :func:`lora_shrink`."""
    acc = _acc_dtype(x, down)
    s = torch.matmul(x.to(acc), down.to(acc).T)
    s.mul_(scale.to(acc))
    return s.to(_shrink_out_dtype(x, down))


def lora_linear_fused_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                s: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T + s @ up.T + bias`` in float32, rounded once to ``x.dtype``.

    Materialises float32 copies of the operands: a fallback and an oracle, not a fast path.
    """
    acc = _acc_dtype(x, weight, s, up, bias)
    out = torch.matmul(x.to(acc), weight.to(acc).T)
    out.addmm_(s.to(acc), up.to(acc).T)
    if bias is not None:
        out.add_(bias.to(acc))
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Kernels


# Shared tile helpers, bound by bind_tiles() when the kernels are built (see there).
dot_over_k = round_bf16 = store_rne = None


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    bind_tiles(globals(), "dot_over_k", "round_bf16", "store_rne")

    @triton.jit
    def shrink_kernel(x_ptr, d_ptr, scale_ptr, o_ptr, T, R, K, K_PER_SPLIT, stride_xt,
                      stride_dr, stride_ot, stride_os,
                      BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                      SPLIT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr):
        # One (BT, BR) tile of S over the K range [pid_k * K_PER_SPLIT, ... + K_PER_SPLIT).
        # With SPLIT > 1 the float32 partial sums go to a workspace (SPLIT, T, R) that the host
        # reduces, scales and rounds; with SPLIT == 1 the tile is scaled and rounded here.
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

    # Nothing specialized on values or alignment (TMA needs neither compiled in): one binary per
    # dtypes and constexprs, which CompiledLaunch launches without Triton's dispatch.
    @triton.jit(do_not_specialize=["x_ptr", "w_ptr", "s_ptr", "u_ptr", "o_ptr", "bias_ptr",
                                   "scale_ptr", "T", "N", "K", "R", "stride_xt", "stride_wn",
                                   "stride_st", "stride_un", "stride_ot"])
    def linear_kernel_tma(x_ptr, w_ptr, s_ptr, u_ptr, o_ptr, bias_ptr, scale_ptr,
                          T, N, K, R, stride_xt, stride_wn, stride_st, stride_un, stride_ot,
                          N_PROGS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, BR: tl.constexpr, GROUP: tl.constexpr,
                          HAS_LORA: tl.constexpr,
                          HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr,
                          OUT_BF16: tl.constexpr, STAGES: tl.constexpr):
        # out = x @ W.T (+ S @ B.T) (* scale per column) (+ bias), one float32 accumulator per
        # tile, rounded once. Hopper form: every operand tile arrives by TMA bulk copy into
        # shared memory (pipelined STAGES deep), and the N_PROGS persistent programs walk the
        # tiles in the swizzled order, so one tile's epilogue overlaps the next tile's loads.
        # Also the shrink: x against the down factor, with the per-rank scale as column scale.
        # Descriptors are built here, on the device (see shuttle.kernels.tma).
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[T, K], strides=[stride_xt, 1],
                                           block_shape=[BT, BK])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1],
                                           block_shape=[BN, BK])
        o_desc = tl.make_tensor_descriptor(o_ptr, shape=[T, N], strides=[stride_ot, 1],
                                           block_shape=[BT, BN])
        if HAS_LORA:
            s_desc = tl.make_tensor_descriptor(s_ptr, shape=[T, R], strides=[stride_st, 1],
                                               block_shape=[BT, BR])
            u_desc = tl.make_tensor_descriptor(u_ptr, shape=[N, R], strides=[stride_un, 1],
                                               block_shape=[BN, BR])
        grid_t = tl.cdiv(T, BT)
        grid_n = tl.cdiv(N, BN)
        in_group = GROUP * grid_n
        # N_PROGS is a compile-time constant, as in the stand-alone form of this kernel (which
        # runs close to cuBLAS); it is the SM count whatever the shape (programs beyond the
        # tiles exit at once), so that new row counts compile nothing new.
        for tile in tl.range(tl.program_id(0), grid_t * grid_n, N_PROGS, flatten=True,
                             num_stages=STAGES):
            first_t = (tile // in_group) * GROUP
            group_t = tl.minimum(grid_t - first_t, GROUP)
            ot = (first_t + (tile % in_group) % group_t) * BT
            on = ((tile % in_group) // group_t) * BN
            acc = tl.zeros((BT, BN), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BK)):
                a = x_desc.load([ot, k * BK])
                b = w_desc.load([on, k * BK])
                if IEEE:  # the interpreter, whose bf16 dot is wrong
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc,
                                 input_precision="ieee")
                else:
                    acc = tl.dot(a, b.T, acc)
            if HAS_LORA:
                for r in range(0, tl.cdiv(R, BR)):
                    a = s_desc.load([ot, r * BR])
                    b = u_desc.load([on, r * BR])
                    if IEEE:
                        acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc,
                                     input_precision="ieee")
                    else:
                        acc = tl.dot(a, b.T, acc)
            rn = on + tl.arange(0, BN)
            if HAS_SCALE:
                acc = acc * tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if OUT_BF16:
                o_desc.store([ot, on], round_bf16(acc))
            else:  # float16: the TMA path takes bf16 or fp16 operands only
                o_desc.store([ot, on], acc.to(tl.float16))

    return shrink_kernel, fused_kernel, CompiledLaunch(linear_kernel_tma)


# ----------------------------------------------------------------------------------------------
# Dispatch


def _use_kernel(interpret: bool, *tensors: torch.Tensor | None) -> bool:
    present = [t for t in tensors if t is not None]
    if not triton_available():
        return False
    if any(t.dtype not in _KERNEL_DTYPES for t in present):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return False  # the kernels have no backward; the reference is differentiable
    return present[0].is_cuda or interpret


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dimension (copied only when it has not)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _ieee(a: torch.dtype, b: torch.dtype, interpret: bool) -> bool:
    """Whether a dot of these operand dtypes runs as an IEEE float32 dot (else a native one)."""
    return a != b or a == torch.float32 or interpret


_SMEM_BUDGET = 160 * 1024  # staged operand tiles; sm_90 allows 227 KiB per block


def _fit_step(step: int, rows: int, cols: int, a_bytes: int, b_bytes: int, stages: int) -> int:
    """Halve a reduction step (down to 16) until ``stages`` staged tiles fit the budget."""
    while step > 16 and stages * step * (rows * a_bytes + cols * b_bytes) > _SMEM_BUDGET:
        step //= 2
    return step


def lora_shrink(x: torch.Tensor, down: torch.Tensor, scale: torch.Tensor,
                config: tuple[int, int, int, int, int, int] | None = None,
                tma: bool | None = None) -> torch.Tensor:
    """``S = (x @ down.T) * scale``: the rank-wide LoRA intermediate, rounded once.

    Args:
        x: (T, K) activations, bf16/fp16/fp32.
        down: (R, K) down factor(s), of x's dtype or float32.
        scale: (R,) per-rank scale (float32), e.g. strength x alpha / rank for each adapter's ranks.
        config: a :class:`ShrinkConfig` (or the same 6-tuple) to override
            :data:`SHRINK_CUDA_CONFIG` (or the small interpreter blocks).
        tma: use the Hopper TMA kernel (:data:`SHRINK_TMA_CONFIG`); default: where it applies
            (see :func:`lora_linear_fused`) and R is a multiple of 8.

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
    if t == 0 or r == 0 or not _use_kernel(interpret, x, down, scale):
        return lora_shrink_reference(x, down, scale)

    x, down = _rows(x), _rows(down)
    scale = scale.to(torch.float32).contiguous()
    out_dtype = _shrink_out_dtype(x, down)
    if tma or (tma is None and not interpret and t > _SMALL_T
               and _tma_dtypes(x, down) and tma_addressable(x, down) and r % 8 == 0):
        out = torch.empty(t, r, dtype=out_dtype, device=x.device)
        _linear_tma(x, down, None, None, None, scale, out, SHRINK_TMA_CONFIG)
        return out
    cfg = ShrinkConfig(*(config or (_SHRINK_INTERPRET_CONFIG if interpret else SHRINK_CUDA_CONFIG)))
    bt = cfg.block_t
    br = min(max(16, cfg.block_r), max(16, next_power_of_2(r)))
    bk = _fit_step(cfg.block_k, bt, br, x.element_size(), down.element_size(), cfg.num_stages)
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
    with on_device_of(x):
        _kernels()[0][(cdiv(t, bt), cdiv(r, br), split)](
            x, down, scale, out, t, r, k, per_split * bk, x.stride(0), down.stride(0),
            out.stride(1), out.stride(0),
            BT=bt, BR=br, BK=bk, SPLIT=split, IEEE=_ieee(x.dtype, down.dtype, interpret),
            EVEN_K=k % bk == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        return out.sum(0).mul_(scale).to(out_dtype)
    return out[0]


def lora_linear_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      s: torch.Tensor, up: torch.Tensor,
                      config: tuple[int, int, int, int, int, int, int] | None = None,
                      tma: bool | None = None) -> torch.Tensor:
    """``out = x @ weight.T + s @ up.T + bias`` in one kernel, float32 accumulator, one rounding.

    Args:
        x: (T, K) activations, bf16/fp16/fp32.
        weight: (N, K) base weight, normally of x's dtype.
        bias: (N,) or None.
        s: (T, R) the scaled LoRA intermediate from :func:`lora_shrink` (x's dtype or float32).
        up: (N, R) up factor(s), of s's dtype or float32. When ``s`` or ``up`` is float32 the
            rank part runs as an IEEE float32 dot; so does the base part for float32 operands.
        config: a :class:`FusedConfig` (or the same 7-tuple) to override
            :data:`FUSED_CUDA_CONFIG` / :data:`FUSED_CUDA_SMALL_T_CONFIG` (or the interpreter's).
        tma: use the Hopper kernel (TMA loads, persistent tiles; ``config``, else
            :data:`FUSED_TMA_CONFIG`, or :data:`FUSED_TMA_NARROW_CONFIG` where the wide tiles
            fill the SMs' last round below :data:`FILL_FOR_WIDE_TILES`); default: for T > 64
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
    if t == 0 or n == 0 or r == 0 or not _use_kernel(interpret, x, weight, bias, s, up):
        return lora_linear_fused_reference(x, weight, bias, s, up)

    if tma or (tma is None and not interpret and t > _SMALL_T and _tma_dtypes(x, weight, s, up)
               and tma_addressable(x, weight, s, up) and n % 8 == 0):
        out = torch.empty(t, n, dtype=x.dtype, device=x.device)
        cfg = (FusedConfig(*config) if config
               else _fused_tma_config(t, n, sm_count(x.device.index) if x.is_cuda else 1))
        _linear_tma(x, weight, s, up, bias, None, out, cfg)
        return out
    if config is not None:
        cfg = FusedConfig(*config)
    elif interpret:
        cfg = _FUSED_INTERPRET_CONFIG
    else:
        cfg = FUSED_CUDA_SMALL_T_CONFIG if t <= _SMALL_T else FUSED_CUDA_CONFIG
    bt = cfg.block_t or min(_SMALL_T, max(16, next_power_of_2(t)))
    bn = cfg.block_n
    # float32 operands take twice the staged shared memory: shorter K/rank steps keep them fit.
    bk = _fit_step(cfg.block_k, bt, bn, x.element_size(), weight.element_size(), cfg.num_stages)
    br = _fit_step(min(max(16, cfg.block_r), max(16, next_power_of_2(r))), bt, bn,
                   s.element_size(), up.element_size(), cfg.num_stages)
    x, weight, s, up = _rows(x), _rows(weight), _rows(s), _rows(up)
    if bias is not None:
        bias = bias.contiguous()
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    grid = (cdiv(t, bt) * cdiv(n, bn),)
    with on_device_of(x):
        _kernels()[1][grid](
            x, weight, bias if bias is not None else out, s, up, out, t, n, k, r,
            x.stride(0), weight.stride(0), s.stride(0), up.stride(0), out.stride(0),
            BT=bt, BN=bn, BK=bk, BR=br, GROUP=max(1, cfg.group), HAS_BIAS=bias is not None,
            BASE_IEEE=_ieee(x.dtype, weight.dtype, interpret),
            LORA_IEEE=_ieee(s.dtype, up.dtype, interpret),
            EVEN_K=k % bk == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


class PreparedLoraLinear:
    """The fused tier's Hopper path for one layer, its fixed operands checked once.

    :func:`lora_shrink` and :func:`lora_linear_fused` check every operand on every call, which
    costs about as much host time as the launches themselves. A dynamic layer's weight, bias
    and factors stay put between calls: built for them, this checks them once, and a call
    checks x alone and launches the same two kernels with the same configurations, so its
    result is theirs bit for bit.

    ``usable`` is False where the TMA path does not apply to the fixed operands; a call answers
    None where it does not apply to x (few rows, another dtype or device, misaligned rows,
    autograd recording): then use the functions.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, down: torch.Tensor,
                 up: torch.Tensor) -> None:
        # The layer's weight and bias weakly (a replaced parameter is not kept alive here); the
        # factors strongly (the caller's own tensors).
        self._weight = weakref.ref(weight)
        self._bias = weakref.ref(bias) if bias is not None else None
        self.down, self.up = down, up
        self._layout = self._layout_of(weight, bias)
        n, k = weight.shape if weight.dim() == 2 else (0, 0)
        r = down.shape[0]
        self.usable = (
            triton_available() and not interpreting() and weight.is_cuda and n > 0 and r > 0
            and down.shape == (r, k) and up.shape == (n, r) and n % 8 == 0 and r % 8 == 0
            and _tma_dtypes(weight, down, up) and tma_addressable(weight, down, up)
            and (bias is None or (bias.shape == (n,) and bias.is_contiguous()
                                  and bias.device == weight.device)))
        if not self.usable:
            return
        self._n, self._k, self._r = n, k, r
        self._dtype, self._device = weight.dtype, weight.get_device()
        self._shrink = _tma_constexprs(SHRINK_TMA_CONFIG, r, 0, False, True, weight.dtype, True)
        self._sms = sm_count(self._device)
        self._fused = {cfg: _tma_constexprs(cfg, n, r, bias is not None, False, weight.dtype, True)
                       for cfg in (FUSED_TMA_CONFIG, FUSED_TMA_NARROW_CONFIG)}

    @staticmethod
    def _layout_of(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        # What a parameter can change without becoming another object (``param.data = ...``,
        # as offloading does): its storage, dtype, shape and strides.
        return (weight.data_ptr(), weight.dtype, weight.shape, weight.stride(),
                bias.data_ptr() if bias is not None else 0)

    def fits(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether this was built for these weight and bias, still as they were laid out."""
        return (weight is self._weight()
                and bias is (self._bias() if self._bias is not None else None)
                and self._layout == self._layout_of(weight, bias))

    def __call__(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
        """``x @ W.T + ((x @ down.T) * scale) @ up.T + bias`` for x (T, K) and a float32
        (R,) ``scale``, with the weight and bias this was built for (see :meth:`fits`); None
        where x does not take the Hopper path.
        """
        t = x.shape[0]
        weight = self._weight()
        bias = self._bias() if self._bias is not None else None
        if (t <= _SMALL_T or weight is None or x.dtype != self._dtype or x.shape[1] != self._k
                or x.get_device() != self._device or x.stride(1) != 1 or x.data_ptr() % 16
                or x.stride(0) % 8 or scale.dtype != torch.float32 or scale.shape != (self._r,)
                or scale.stride(0) != 1
                or (torch.is_grad_enabled()
                    and any(a is not None and a.requires_grad for a in (x, weight, bias, scale)))):
            return None
        s = torch.empty(t, self._r, dtype=x.dtype, device=x.device)
        out = torch.empty(t, self._n, dtype=x.dtype, device=x.device)
        ensure_allocator()
        with on_device_of(x):
            _launch_tma(x, self.down, None, None, None, scale, s, self._sms, self._shrink)
            _launch_tma(x, weight, s, self.up, bias, None, out, self._sms,
                        self._fused[_fused_tma_config(t, self._n, self._sms)])
        return out


def _tma_dtypes(*tensors: torch.Tensor) -> bool:
    """One 16-bit dtype for every operand (the TMA kernel's native dot, 2-byte tiles)."""
    return len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in (torch.bfloat16,
                                                                       torch.float16)


def _fused_tma_config(t: int, n: int, sms: int) -> FusedConfig:
    """FUSED_TMA_CONFIG, or FUSED_TMA_NARROW_CONFIG where its tiles fill the SMs' rounds poorly."""
    tiles = cdiv(t, FUSED_TMA_CONFIG.block_t) * cdiv(n, FUSED_TMA_CONFIG.block_n)
    fill = tiles / (cdiv(tiles, sms) * sms)
    return FUSED_TMA_CONFIG if fill >= FILL_FOR_WIDE_TILES else FUSED_TMA_NARROW_CONFIG


def _tma_constexprs(cfg: FusedConfig, n: int, r: int, has_bias: bool, has_scale: bool,
                    out_dtype: torch.dtype, cuda: bool) -> dict:
    """The TMA kernel's compile-time arguments (all but N_PROGS) for an output of n columns
    and a LoRA part of rank r (0: none, the shrink).
    """
    return {"BT": cfg.block_t,
            # The shrink's output columns are the ranks: its column tile is fitted to them.
            "BN": cfg.block_n if r else max(16, min(cfg.block_n, next_power_of_2(n))),
            "BK": cfg.block_k, "BR": max(16, min(cfg.block_r, next_power_of_2(r))),
            "GROUP": max(1, cfg.group), "HAS_LORA": r > 0, "HAS_BIAS": has_bias,
            "HAS_SCALE": has_scale,
            "IEEE": not cuda,  # off CUDA this runs in the interpreter
            "OUT_BF16": out_dtype == torch.bfloat16, "STAGES": cfg.num_stages,
            "num_warps": cfg.num_warps}


def _launch_tma(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None,
                up: torch.Tensor | None, bias: torch.Tensor | None, scale: torch.Tensor | None,
                out: torch.Tensor, progs: int, constexprs: dict) -> None:
    """``out = x @ w.T (+ s @ up.T) (* scale) (+ bias)`` by the TMA kernel (see _kernels), on
    checked operands (contiguous bias, TMA-addressable tensors), with ``progs`` persistent
    programs and :func:`_tma_constexprs`; the caller installs Triton's allocator
    (:func:`ensure_allocator`) and enters x's device.
    """
    t, k = x.shape
    n = w.shape[0]
    # Without a LoRA part (the shrink), x and w stand in for the unused S and B (never read).
    s_, up_ = (s, up) if s is not None else (x, w)
    _kernels()[2](
        (progs,), x, w, s_, up_, out, bias if bias is not None else out,
        scale if scale is not None else out, t, n, k, s_.shape[1] if s is not None else 0,
        x.stride(0), w.stride(0), s_.stride(0), up_.stride(0), out.stride(0),
        N_PROGS=progs, **constexprs)


def _linear_tma(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None,
                up: torch.Tensor | None, bias: torch.Tensor | None, scale: torch.Tensor | None,
                out: torch.Tensor, cfg: FusedConfig) -> None:
    """``out = x @ w.T (+ s @ up.T) (* scale) (+ bias)`` by the TMA kernel (see _kernels)."""
    if bias is not None:
        bias = bias.contiguous()
    cx = _tma_constexprs(cfg, w.shape[0], s.shape[1] if s is not None else 0, bias is not None,
                         scale is not None, out.dtype, x.is_cuda)
    # One persistent program per SM (see the kernel's N_PROGS); two under the interpreter.
    progs = sm_count(x.device.index) if x.is_cuda else 2
    ensure_allocator()
    with on_device_of(x):
        _launch_tma(x, w, s, up, bias, scale, out, progs, cx)
