"""The LoRA linear's Hopper kernel: TMA tile loads, persistent programs, one rounding.

For x (T, K), w (N, K) and, optionally, S (T, R) and B (N, R), a per-column scale (N,) and a
bias (N,), one kernel computes::

    out = x @ w.T (+ S @ B.T) (* scale) (+ bias)      # (T, N), float32 accumulator, rounded once

Every operand tile arrives by TMA bulk copy into shared memory and one persistent program per SM
walks the output tiles, so one tile's epilogue overlaps the next tile's loads. It serves both
steps of the unmerged LoRA linear, by default for T > 64 on CUDA devices of compute capability
9.0+ when all operands share one 16-bit dtype and are 16-byte aligned:

* the shrink (:func:`shuttle.kernels.lora_shrink.lora_shrink`): x against the down factor
  A (R, K), no LoRA part, the ranks as output columns and the per-rank scale as column scale;
* the fused linear (:func:`shuttle.kernels.lora_linear.lora_linear_fused`): x against the base
  weight W, S against the up factor B, plus the bias.

:class:`PreparedLoraLinear` runs the two for one layer whose weight, bias and factors it has
checked once; a call checks x alone.
"""

from __future__ import annotations

import functools
import warnings

import torch

from shuttle.kernels.cute_dsl import CUTE_TILES, PINGPONG_TILES, best_tile
from shuttle.kernels.launch import (
    CompiledLaunch,
    LayerOperands,
    cdiv,
    dependent_launch,
    interpreting,
    next_power_of_2,
    on_device_of,
    sm_count,
    triton_available,
)
from shuttle.kernels.lora_launch import SMALL_T, FusedConfig
from shuttle.kernels.tma import ensure_allocator, tma_addressable

__all__ = [
    "FILL_FOR_WIDE_TILES",
    "FUSED_FORMS",
    "FUSED_TMA_CONFIG",
    "FUSED_TMA_NARROW_CONFIG",
    "SHRINK_TMA_CONFIG",
    "PreparedLoraLinear",
    "fused_tma_config",
    "linear_tma",
    "tma_dtypes",
]

# What a PreparedLoraLinear runs (the fused tiers of shuttle.apply.tier): Triton's shrink and
# fused GEMM; the CuTe GEMM after that shrink; the CuTe GEMM computing S among its units; the
# ping-pong tile's CuTe GEMM after the shrink.
FUSED_FORMS = ("fused", "fused_cute", "fused_cute_shrink", "fused_cute_pingpong")

# Defaults for sm_90 (132 SMs, 227 KiB shared memory per block).
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


# ----------------------------------------------------------------------------------------------
# Kernels


# Shared tile helpers, bound by tiles.bind_tiles() when the kernel is built (see there).
round_bf16 = wait_for_primary = None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    from shuttle.kernels.tiles import bind_tiles

    bind_tiles(globals(), "round_bf16", "wait_for_primary")

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
                          OUT_BF16: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
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
                if PDL:  # launched as the shrink's programmatic dependent: S once it ended
                    wait_for_primary()
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

    return CompiledLaunch(linear_kernel_tma)


# ----------------------------------------------------------------------------------------------
# Dispatch


class PreparedLoraLinear:
    """The fused tier's Hopper path for one layer, its fixed operands checked once.

    :func:`~shuttle.kernels.lora_shrink.lora_shrink` and
    :func:`~shuttle.kernels.lora_linear.lora_linear_fused` check every operand on every call,
    which costs about as much host time as the launches themselves. A dynamic layer's weight,
    bias and factors stay put between calls: built for them, this checks them once, and a call
    checks x alone and launches the same two kernels with the same configurations, so its
    result is theirs bit for bit.

    ``form`` (one of :data:`FUSED_FORMS`, the fused tiers' names) says what runs: ``"fused"``
    Triton's two kernels; ``"fused_cute"`` the CuTe-DSL Hopper GEMM
    (:mod:`shuttle.kernels.lora_linear_cute`) for the second, where it runs (the ``hopper``
    extra, an sm_90 device; ``self.cute`` says whether it does), the same roundings (S once, the
    output once) by a warp-specialized pipeline; ``"fused_cute_shrink"`` that kernel computing S
    itself among its work units (x read from memory once; ranks up to 128, else after Triton's
    shrink); ``"fused_cute_pingpong"`` the ping-pong tile's GEMM
    (:data:`~shuttle.kernels.cute_dsl.PINGPONG_TILES`) after Triton's shrink.

    With ``pdl`` (the default) Triton's GEMM after the short shrink is launched as the shrink's
    programmatic dependent where the device allows (sm_90): it starts streaming x and W while
    the shrink runs, and reads S after its end (False: in stream order). The CuTe GEMM after
    the shrink stays in stream order: launched as a dependent (``CuteLoraGemm(pdl=True)``) it
    measured slower at three of seven shapes (up to a third at Z-Image's FFN up,
    docs/benchmarks.md).

    ``usable`` is False where the TMA path does not apply to the fixed operands; a call answers
    None where it does not apply to x (few rows, another dtype or device, misaligned rows,
    autograd recording): then use the functions.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, down: torch.Tensor,
                 up: torch.Tensor, form: str = "fused", pdl: bool = True) -> None:
        if form not in FUSED_FORMS:
            raise ValueError(f"form must be one of {FUSED_FORMS}, not {form!r}")
        # The layer's weight and bias weakly; the factors strongly (the caller's own tensors).
        self._operands = LayerOperands(weight, bias)
        self.down, self.up = down, up
        n, k = weight.shape if weight.dim() == 2 else (0, 0)
        r = down.shape[0]
        self.usable = (
            triton_available() and not interpreting() and weight.is_cuda and n > 0 and r > 0
            and down.shape == (r, k) and up.shape == (n, r) and n % 8 == 0 and r % 8 == 0
            and tma_dtypes(weight, down, up) and tma_addressable(weight, down, up)
            and (bias is None or (bias.shape == (n,) and bias.is_contiguous()
                                  and bias.device == weight.device)))
        self.cute = False
        if not self.usable:
            return
        self._n, self._k, self._r = n, k, r
        self._dtype, self._device = weight.dtype, weight.get_device()
        pdl = pdl and dependent_launch(self._device)
        self._shrink = _tma_constexprs(SHRINK_TMA_CONFIG, r, 0, False, True, weight.dtype, True)
        # lora_shrink's choice for short inputs, the same kernel (imported here: that module
        # imports this one)
        from shuttle.kernels.lora_shrink import launch_short_shrink, short_shrink

        self._short_shrink = short_shrink, launch_short_shrink
        self._sms = sm_count(self._device)
        configs = (FUSED_TMA_CONFIG, FUSED_TMA_NARROW_CONFIG)
        self._fused = {cfg: _tma_constexprs(cfg, n, r, bias is not None, False, weight.dtype, True)
                       for cfg in configs}
        # Triton's GEMM as the shrink's programmatic dependent only after the short shrink: it
        # makes its TMA descriptors in allocator scratch at its start, which may be the block
        # the TMA shrink's own descriptors held (freed at that launch) while that still runs.
        self._fused_after_short = {
            cfg: _tma_constexprs(cfg, n, r, bias is not None, False, weight.dtype, True, True)
            for cfg in configs} if pdl else self._fused
        self._cute: dict = {}
        self._pingpong = form == "fused_cute_pingpong"
        if form != "fused":
            self._cute = _cute_gemms(weight, bias, down if form == "fused_cute_shrink" else None,
                                     up, PINGPONG_TILES if self._pingpong else CUTE_TILES)
            self.cute = bool(self._cute)
        # S among the CuTe kernel's units (its tile picked counting them)
        self._one_kernel = any(gemm.shrink for gemm in self._cute.values())

    def fits(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether this was built for these weight and bias, still as they were laid out."""
        return self._operands.fits(weight, bias)

    def __call__(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
        """``x @ W.T + ((x @ down.T) * scale) @ up.T + bias`` for x (T, K) and a float32
        (R,) ``scale``, with the weight and bias this was built for (see :meth:`fits`); None
        where x does not take the Hopper path.
        """
        t = x.shape[0]
        weight, bias = self._operands.get()
        if (t <= SMALL_T or weight is None or x.dtype != self._dtype or x.shape[1] != self._k
                or x.get_device() != self._device or x.stride(1) != 1 or x.data_ptr() % 16
                or x.stride(0) % 8 or scale.dtype != torch.float32 or scale.shape != (self._r,)
                or scale.stride(0) != 1
                or (torch.is_grad_enabled()
                    and any(a is not None and a.requires_grad for a in (x, weight, bias, scale)))):
            return None
        out = torch.empty(t, self._n, dtype=x.dtype, device=x.device)
        gemm = None
        if self._cute:
            gemm = self._cute[best_tile(t, self._n, self._sms, self._one_kernel,
                                        self._pingpong)]
            if gemm.shrink:  # one kernel, S among its units (None: not in this capture)
                with on_device_of(x):
                    if gemm(x, weight, bias, scale, out) is not None:
                        return out
                gemm = None  # Triton's kernels for this call
        s = torch.empty(t, self._r, dtype=x.dtype, device=x.device)
        ensure_allocator()
        short, launch_short = self._short_shrink
        with on_device_of(x):
            short_shrink = short(t, self._k)
            if short_shrink:
                launch_short(x, self.down, scale, s)
            else:
                _launch_tma(x, self.down, None, None, None, scale, s, self._sms, self._shrink)
            if gemm is not None:
                gemm(x, weight, bias, s, out)
            else:
                fused = self._fused_after_short if short_shrink else self._fused
                _launch_tma(x, weight, s, self.up, bias, None, out, self._sms,
                            fused[fused_tma_config(t, self._n, self._sms)])
        return out


def _cute_gemms(weight: torch.Tensor, bias: torch.Tensor | None, down: torch.Tensor | None,
                up: torch.Tensor, tiles: tuple) -> dict:
    """The CuTe kernel for this layer per tile of ``tiles`` (computing S itself given ``down``
    where the rank allows, else after Triton's shrink, in stream order: see
    :class:`PreparedLoraLinear`), or {} where it does not run (no DSL, not sm_90, operands it
    does not take, or a build that failed: then Triton's kernels serve, with a warning saying
    why).
    """
    from shuttle.kernels.lora_linear_cute import CuteLoraGemm, cute_available

    if not (cute_available(weight.device) and CuteLoraGemm.supports(weight, up)):
        return {}
    try:
        return {tile: CuteLoraGemm(weight, up, bias is not None, tile,
                                   down if down is not None
                                   and CuteLoraGemm.supports(weight, up, down, tile) else None)
                for tile in tiles}
    except Exception as e:  # the DSL's own errors: a version or driver it does not take
        warnings.warn(f"the CuTe LoRA kernel could not be built ({type(e).__name__}: {e}); "
                      "the fused tier runs Triton's kernel instead", RuntimeWarning,
                      stacklevel=3)
        return {}


def tma_dtypes(*tensors: torch.Tensor) -> bool:
    """One 16-bit dtype for every operand (the TMA kernel's native dot, 2-byte tiles)."""
    return len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in (torch.bfloat16,
                                                                       torch.float16)


def fused_tma_config(t: int, n: int, sms: int) -> FusedConfig:
    """FUSED_TMA_CONFIG, or FUSED_TMA_NARROW_CONFIG where its tiles fill the SMs' rounds poorly."""
    fill = _round_fill(t, n, FUSED_TMA_CONFIG.block_t, FUSED_TMA_CONFIG.block_n, sms)
    return FUSED_TMA_CONFIG if fill >= FILL_FOR_WIDE_TILES else FUSED_TMA_NARROW_CONFIG


def _round_fill(t: int, n: int, block_t: int, block_n: int, sms: int) -> float:
    """The share of the SMs' rounds that ``block_t`` x ``block_n`` output tiles keep busy."""
    tiles = cdiv(t, block_t) * cdiv(n, block_n)
    return tiles / (cdiv(tiles, sms) * sms)


def _tma_constexprs(cfg: FusedConfig, n: int, r: int, has_bias: bool, has_scale: bool,
                    out_dtype: torch.dtype, cuda: bool, pdl: bool = False) -> dict:
    """The TMA kernel's compile-time arguments (all but N_PROGS) for an output of n columns
    and a LoRA part of rank r (0: none, the shrink); with ``pdl`` the GEMM (r > 0) is launched
    as the shrink's programmatic dependent.
    """
    return {"BT": cfg.block_t,
            # The shrink's output columns are the ranks: its column tile is fitted to them.
            "BN": cfg.block_n if r else max(16, min(cfg.block_n, next_power_of_2(n))),
            "BK": cfg.block_k, "BR": max(16, min(cfg.block_r, next_power_of_2(r))),
            "GROUP": max(1, cfg.group), "HAS_LORA": r > 0, "HAS_BIAS": has_bias,
            "HAS_SCALE": has_scale,
            "IEEE": not cuda,  # off CUDA this runs in the interpreter
            "OUT_BF16": out_dtype == torch.bfloat16, "STAGES": cfg.num_stages,
            "PDL": pdl and r > 0, "num_warps": cfg.num_warps, "launch_pdl": pdl and r > 0}


def _launch_tma(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None,
                up: torch.Tensor | None, bias: torch.Tensor | None, scale: torch.Tensor | None,
                out: torch.Tensor, progs: int, constexprs: dict) -> None:
    """``out = x @ w.T (+ s @ up.T) (* scale) (+ bias)`` by the TMA kernel (see _kernel), on
    checked operands (contiguous bias, TMA-addressable tensors), with ``progs`` persistent
    programs and :func:`_tma_constexprs`; the caller installs Triton's allocator
    (:func:`ensure_allocator`) and enters x's device.
    """
    t, k = x.shape
    n = w.shape[0]
    # Without a LoRA part (the shrink), x and w stand in for the unused S and B (never read).
    s_, up_ = (s, up) if s is not None else (x, w)
    _kernel()(
        (progs,), x, w, s_, up_, out, bias if bias is not None else out,
        scale if scale is not None else out, t, n, k, s_.shape[1] if s is not None else 0,
        x.stride(0), w.stride(0), s_.stride(0), up_.stride(0), out.stride(0),
        N_PROGS=progs, **constexprs)


def linear_tma(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None,
               up: torch.Tensor | None, bias: torch.Tensor | None, scale: torch.Tensor | None,
               out: torch.Tensor, cfg: FusedConfig) -> None:
    """``out = x @ w.T (+ s @ up.T) (* scale) (+ bias)`` by the TMA kernel (see _kernel)."""
    if bias is not None:
        bias = bias.contiguous()
    cx = _tma_constexprs(cfg, w.shape[0], s.shape[1] if s is not None else 0, bias is not None,
                         scale is not None, out.dtype, x.is_cuda)
    # One persistent program per SM (see the kernel's N_PROGS); two under the interpreter.
    progs = sm_count(x.device.index) if x.is_cuda else 2
    ensure_allocator()
    with on_device_of(x):
        _launch_tma(x, w, s, up, bias, scale, out, progs, cx)
