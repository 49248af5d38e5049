"""LoRA at a few tokens (decode): the update in one launch, or the whole layer in two.

For T <= 64 rows the update ``((x @ A.T) * scale) @ B.T`` is tiny work spread over three or
more launches (shrink GEMM, scale, expand GEMM with the add), each a few microseconds of fixed
cost, which is why a dynamic adapter can double a decode step. :func:`lora_decode_add` does it
in one launch: its first programs compute split-K partials of the (T, R) intermediate
``h = x @ A.T`` in float32 (one per K range of 256) while the others load their BN columns of
the output and of the up factor; those then sum the partials in a fixed order (deterministic),
scale ``h`` in float32, multiply it by their columns of the up factor in float32 (``h`` is never
rounded), add the base output tile and round once. Programs take those roles in the order they
start, so no wait depends on the hardware's scheduling (``shuttle.kernels.tiles``; the counters
and workspace: :mod:`shuttle.kernels.semaphore`). Split, because a program computing all of
``h`` itself would chain K / 128 dependent steps of L2 reads before its own work.

:func:`lora_decode_linear` is the fused tier's decode form: the whole layer
``x @ W.T + ((x @ A.T) * scale) @ B.T + bias``. A split-K shrink writes float32 partials of
``h = x @ A.T`` (a few small programs, one per K range); then each output program streams its BN
rows of W once (at decode the layer is bound by reading W; on sm_90 and later the output kernel
is the shrink's programmatic dependent, so that stream starts under the shrink and only the
partials wait for its end), sums the partials in a fixed order,
adds ``(h * scale) @ B[rn].T`` (float32, ``h`` never rounded) and the bias, and rounds once. No
base output is written and read back. (Two one-launch forms are slower where it counts: every
output program accumulating the whole of ``h`` beside its base product, whose extra per-step
loads of A cost more than the second launch; and the first programs publishing the partials as
the update's do, bit-identical and faster eagerly, but slower in CUDA graphs, where a second
launch costs less than the partials' programs holding SM slots and the gather.)

:class:`PreparedLoraDecode` launches both for one layer whose factors (and weight) stay put,
checked once. :func:`lora_decode_add_reference` and :func:`lora_decode_linear_reference` are
the same computations in PyTorch: the fallbacks and oracles. The kernels themselves:
:mod:`shuttle.kernels.lora_decode_device`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from shuttle.kernels.launch import (
    BoundLaunch,
    LayerOperands,
    cdiv,
    dependent_launch,
    interpreting,
    next_power_of_2,
    on_device_of,
    sm_count,
    triton_available,
)
from shuttle.kernels.lora_decode_device import decode_kernels
from shuttle.kernels.semaphore import launch_scratch

__all__ = [
    "DECODE_LINEAR_CONFIG",
    "DECODE_MAX_T",
    "DecodeConfig",
    "PreparedLoraDecode",
    "lora_decode_add",
    "lora_decode_add_reference",
    "lora_decode_linear",
    "lora_decode_linear_reference",
]

DECODE_MAX_T = 64  # rows the kernel takes: one program holds all of x's rows
_DTYPES = (torch.bfloat16, torch.float16)
_MAX_R = 256  # the (T, R) intermediate and (R, BN) factor tile stay in registers


def lora_decode_add_reference(out: torch.Tensor, x: torch.Tensor, down: torch.Tensor,
                              up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``out += ((x @ down.T) * scale) @ up.T`` in float32, rounded once into ``out``."""
    h = (x.float() @ down.float().T) * scale.float()
    out.copy_(out.float().addmm_(h, up.float().T))
    return out


def lora_decode_linear_reference(x: torch.Tensor, weight: torch.Tensor,
                                 bias: torch.Tensor | None, down: torch.Tensor, up: torch.Tensor,
                                 scale: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T + ((x @ down.T) * scale) @ up.T + bias`` in float32, rounded once."""
    xf = x.float()
    h = (xf @ down.float().T) * scale.float()
    out = torch.addmm(xf @ weight.float().T, h, up.float().T)
    if bias is not None:
        out.add_(bias.float())
    return out.to(x.dtype)


def lora_decode_add(out: torch.Tensor, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
                    scale: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """In place: ``out += ((x @ down.T) * scale) @ up.T``, float32 throughout, one rounding.

    Args:
        out: (T, N) the base output, T <= :data:`DECODE_MAX_T`, bf16/fp16, unit column stride.
        x: (T, K) activations of ``out``'s dtype.
        down: (R, K) and up: (N, R) factors of ``out``'s dtype (several adapters concatenated
            along R).
        scale: (R,) float32 per-rank scale.
        block_n: output columns per program.

    Returns:
        ``out``. Uses the Triton kernel on CUDA (or under ``TRITON_INTERPRET=1``) for these
        dtypes, else :func:`lora_decode_add_reference`. :class:`PreparedLoraDecode` runs it
        for a layer whose factors stay put, with less host time per call.

    Raises:
        ValueError: shapes that do not fit together, or T above :data:`DECODE_MAX_T`.
    """
    t, k = x.shape
    n, r = up.shape
    if out.shape != (t, n) or down.shape != (r, k) or scale.shape != (r,):
        raise ValueError(f"lora_decode_add: out (T, N), x (T, K), down (R, K), up (N, R), scale "
                         f"(R,) expected, got {tuple(out.shape)}, {tuple(x.shape)}, "
                         f"{tuple(down.shape)}, {tuple(up.shape)}, {tuple(scale.shape)}")
    if t > DECODE_MAX_T:
        raise ValueError(f"lora_decode_add takes at most {DECODE_MAX_T} rows, got {t}")
    interpret = interpreting()  # read once: an environment lookup costs microseconds
    dt = out.dtype
    usable = (triton_available() and (out.is_cuda or interpret) and dt in _DTYPES
              and x.dtype == dt and down.dtype == dt and up.dtype == dt
              and out.stride(1) == 1 and x.stride(1) == 1 and down.stride(1) == 1
              and up.stride(1) == 1 and t > 0 and 0 < r <= _MAX_R)
    if not usable:
        return lora_decode_add_reference(out, x, down, up, scale)
    sx, sd, su, so = x.stride(0), down.stride(0), up.stride(0), out.stride(0)
    aligned = (k % 16 == 0 and n % 16 == 0 and _rows_aligned(x, sx) and _rows_aligned(down, sd)
               and _rows_aligned(out, so))
    plan = _add_launch(t, k, n, r, block_n, interpret, aligned,
                       r % 16 == 0 and _rows_aligned(up, su))
    sem, ws = launch_scratch(x.device, plan.floats)
    with on_device_of(x):
        decode_kernels()[0](plan.grid, x, down, up, _float32(scale), ws, sem, out, t, k, n, r,
                            plan.per, plan.n_out, sx, sd, su, so, **plan.constexprs)
    return out


class _AddLaunch(NamedTuple):
    """The launch of :func:`lora_decode_add` for one (T, K, N, R) and layout."""

    per: int  # K elements per partial of h
    n_out: int  # output programs (after the partials' programs)
    floats: int  # the partials' workspace
    grid: tuple[int]
    constexprs: dict[str, Any]


def _split(k: int, step: int, shrink_k: int) -> tuple[int, int]:
    """(partials, K elements per partial): about ``shrink_k`` each in whole steps, at most
    :data:`_MAX_PARTS`.
    """
    per = max(cdiv(shrink_k, step), cdiv(cdiv(k, step), _MAX_PARTS)) * step
    return cdiv(k, per), per


def _add_launch(t: int, k: int, n: int, r: int, block_n: int, interpret: bool, aligned: bool,
                up_aligned: bool) -> _AddLaunch:
    """How :func:`lora_decode_add` launches for these sizes and alignment flags."""
    cfg = _INTERPRET_LINEAR_CONFIG if interpret else DECODE_LINEAR_CONFIG
    bt, br = max(16, next_power_of_2(t)), max(16, next_power_of_2(r))
    parts, per = _split(k, cfg.block_k, cfg.shrink_k)
    n_out = cdiv(n, block_n)
    return _AddLaunch(per, n_out, parts * bt * br, (parts + n_out,), {
        "BT": bt, "BR": br, "BN": block_n, "SK": cfg.block_k, "H_PARTS": parts,
        "IEEE": interpret, "ALIGNED": aligned, "UP_ALIGNED": up_aligned, "num_warps": 4})


def _float32(scale: torch.Tensor) -> torch.Tensor:
    """The per-rank scale as the kernels read it: float32, unit stride (converted only if not)."""
    if scale.dtype != torch.float32 or scale.stride(0) != 1:
        return scale.to(torch.float32).contiguous()
    return scale


def _rows_aligned(t: torch.Tensor, row_stride: int) -> bool:
    """Every row of the 2-D ``t`` of 2-byte elements starts on 16 bytes."""
    return t.data_ptr() % 16 == 0 and row_stride % 8 == 0


def _aligned(*tensors: torch.Tensor, sizes: tuple[int, ...]) -> bool:
    """The kernels' alignment flags: ``sizes`` (K, N or R: what the masks compare with) are
    multiples of 16, and the 2-D tensors of 2-byte elements have every row start on 16 bytes
    (aligned start, row stride a multiple of 8 elements).
    """
    return all(v % 16 == 0 for v in sizes) and all(
        t.element_size() == 2 and _rows_aligned(t, t.stride(0)) for t in tensors)


class DecodeConfig(NamedTuple):
    """Launch parameters of :func:`lora_decode_linear` (a plain tuple in this order works too)."""

    block_n: int  # output columns per program
    block_k: int  # base reduction step
    num_warps: int
    num_stages: int
    shrink_k: int  # K elements per partial-shrink program (> 0)


# At decode the layer is bound by reading W once: column tiles narrow enough for every SM to
# stream its share, block_n 64 where that still gives 1.5 programs per SM, else 32 (the choice
# of tile, steps and warps: docs/benchmarks/fused_breakdown_decode.md). h comes from partials of
# 256 K elements each, written by a separate split-K shrink: accumulating h in the main kernel
# is slower (see the module docstring).
# Under the interpreter: small steps, so test shapes span several of them.
DECODE_LINEAR_CONFIG = DecodeConfig(32, 128, 4, 3, 256)
_INTERPRET_LINEAR_CONFIG = DecodeConfig(16, 16, 1, 1, 32)
_MAX_PARTS = 64  # partial intermediates each output program sums (16 KiB of L2 reads at most)


def _decode_config(n: int, device: torch.device) -> DecodeConfig:
    cfg = DECODE_LINEAR_CONFIG
    if cdiv(n, 2 * cfg.block_n) >= 1.5 * sm_count(device.index):
        cfg = cfg._replace(block_n=2 * cfg.block_n)
    return cfg


class _LinearLaunch(NamedTuple):
    """The two launches of :func:`lora_decode_linear` for one (T, K, N, R) and layout."""

    parts: int  # partial intermediates (the shrink's programs)
    per: int  # K elements per partial
    grid: tuple[int]  # the output kernel's
    shrink: dict[str, Any]  # the partial shrink's constexprs
    output: dict[str, Any]  # the output kernel's


def _linear_launch(t: int, k: int, n: int, r: int, cfg: DecodeConfig, interpret: bool,
                   x_aligned: bool, down_aligned: bool, out_aligned: bool,
                   has_bias: bool, pdl: bool) -> _LinearLaunch:
    """How :func:`lora_decode_linear` launches for these sizes, ``cfg`` and alignment flags
    (x's rows and K; the down factor's rows; the weight's and output's rows and N); with
    ``pdl`` the output kernel is the shrink's programmatic dependent (``launch.dependent_launch``:
    it streams W while the shrink runs).
    """
    bt, br = max(16, next_power_of_2(t)), max(16, next_power_of_2(r))
    step = cfg.block_k  # the shrink's K step too; each shrink program takes whole steps
    parts, per = _split(k, step, cfg.shrink_k)
    return _LinearLaunch(
        parts, per, (cdiv(n, cfg.block_n),),
        {"BT": bt, "BK": step, "BR": br, "IEEE": interpret,
         "ALIGNED": x_aligned and down_aligned, "PDL": pdl, "num_warps": 4},
        {"BT": bt, "BK": cfg.block_k, "BR": br, "BN": cfg.block_n, "H_PARTS": parts,
         "HAS_BIAS": has_bias, "EVEN_K": k % cfg.block_k == 0, "IEEE": interpret,
         "ALIGNED": x_aligned and out_aligned, "PDL": pdl, "num_warps": cfg.num_warps,
         "num_stages": cfg.num_stages, "launch_pdl": pdl})


def lora_decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       down: torch.Tensor, up: torch.Tensor, scale: torch.Tensor,
                       config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ weight.T + ((x @ down.T) * scale) @ up.T + bias`` for a few tokens, rounded once.

    Two launches: a split-K shrink writes float32 partials of ``h = x @ down.T`` (one small
    program per K range), then each output program streams its columns of W, sums the partials
    in a fixed order (deterministic), and adds ``(h * scale) @ up[rn].T`` and the bias.

    Args:
        x: (T, K) activations, T <= :data:`DECODE_MAX_T`, bf16/fp16.
        weight: (N, K) base weight, bias: (N,) or None, both of x's dtype.
        down: (R, K) and up: (N, R) factors of x's dtype (several adapters concatenated along
            R, R <= 256).
        scale: (R,) float32 per-rank scale.
        config: a :class:`DecodeConfig` (or the same 5-tuple) to override
            :data:`DECODE_LINEAR_CONFIG` (whose block_n doubles for wide layers).

    Returns:
        (T, N) in x's dtype: float32 accumulation throughout (the (T, R) intermediate is never
        rounded), one rounding. Uses the Triton kernels on CUDA (or under
        ``TRITON_INTERPRET=1``) where the dtypes and strides allow and autograd is not
        recording, else :func:`lora_decode_linear_reference` (differentiable).
        :class:`PreparedLoraDecode` runs it for a layer whose weight and factors stay put,
        with less host time per call.

    Raises:
        ValueError: shapes that do not fit together, T above :data:`DECODE_MAX_T`, or a
            config whose ``shrink_k`` is not positive.
    """
    t, k = x.shape
    n = weight.shape[0]
    r = down.shape[0]
    if (weight.shape != (n, k) or down.shape != (r, k) or up.shape != (n, r)
            or scale.shape != (r,) or (bias is not None and bias.shape != (n,))):
        raise ValueError(f"lora_decode_linear: x (T, K), weight (N, K), bias (N,), down (R, K), "
                         f"up (N, R), scale (R,) expected, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {None if bias is None else tuple(bias.shape)}, "
                         f"{tuple(down.shape)}, {tuple(up.shape)}, {tuple(scale.shape)}")
    if t > DECODE_MAX_T:
        raise ValueError(f"lora_decode_linear takes at most {DECODE_MAX_T} rows, got {t}")
    if config is not None and DecodeConfig(*config).shrink_k <= 0:
        raise ValueError(f"lora_decode_linear: config shrink_k (K per partial) must be "
                         f"positive, got {DecodeConfig(*config).shrink_k}")
    tensors = (x, weight, down, up) + ((bias,) if bias is not None else ())
    interpret = interpreting()  # read once: an environment lookup costs microseconds
    usable = (triton_available() and (x.is_cuda or interpret)
              and x.dtype in _DTYPES and all(u.dtype == x.dtype for u in tensors)
              and all(u.stride(-1) == 1 for u in tensors) and t > 0 and n > 0 and k > 0
              and 0 < r <= _MAX_R
              # the kernel has no backward; the reference is differentiable
              and not (torch.is_grad_enabled() and any(u.requires_grad for u in tensors)))
    if not usable:
        return lora_decode_linear_reference(x, weight, bias, down, up, scale)

    cfg = DecodeConfig(*config) if config is not None else (
        _INTERPRET_LINEAR_CONFIG if interpret else _decode_config(n, x.device))
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    plan = _linear_launch(t, k, n, r, cfg, interpret, _aligned(x, sizes=(k,)),
                          _aligned(down, sizes=()), _aligned(weight, out, sizes=(n,)),
                          bias is not None, x.is_cuda and dependent_launch(x.get_device()))
    _, output, shrink = decode_kernels()
    _launch_linear(plan, x, weight, bias, down, up, _float32(scale), out,
                   functools.partial(shrink, (plan.parts,), **plan.shrink),
                   functools.partial(output, plan.grid, **plan.output))
    return out


def _launch_linear(plan: _LinearLaunch, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, down: torch.Tensor, up: torch.Tensor,
                   scale: torch.Tensor, out: torch.Tensor, shrink: Callable[..., None],
                   output: Callable[..., None]) -> None:
    """``out = lora_decode_linear(x, ...)`` by ``plan``'s launches: ``shrink(*args)`` and
    ``output(*args)`` bound to its grids and constexprs (a fresh float32 workspace between).
    """
    t, k = x.shape
    n, r = up.shape
    ws = torch.empty(plan.parts * plan.shrink["BT"] * plan.shrink["BR"], dtype=torch.float32,
                     device=x.device)
    with on_device_of(x):
        shrink(x, down, ws, t, k, r, plan.per, x.stride(0), down.stride(0))
        output(x, weight, bias if bias is not None else out, up, scale, ws, out, t, k, n, r,
               x.stride(0), weight.stride(0), up.stride(0), out.stride(0))


class PreparedLoraDecode:
    """The decode kernels for one layer's factors, checked once.

    :func:`lora_decode_add` and :func:`lora_decode_linear` check every operand and key their
    launches by every argument on each call. At decode a layer's call is bound by the host's
    time to issue its launches, and a dynamic layer's factors (and, for the whole layer, its
    weight and bias) stay put between calls: built for the factors, this checks them once and
    keeps its launches bound (:class:`~shuttle.kernels.launch.BoundLaunch`) per rows' bucket
    and x's alignment, so that a call checks x, the output and the scale alone. It launches the
    functions' kernels with their constexprs: its results are theirs bit for bit.

    ``pdl``: the whole layer's output kernel launched as the shrink's programmatic dependent
    where the device allows, as :func:`lora_decode_linear` does (False: in stream order).

    ``usable`` is False where the kernels do not take the factors; where they do not take a
    call's operands (or ``usable`` is False) a call goes to the function, which falls back to
    its reference.
    """

    def __init__(self, down: torch.Tensor, up: torch.Tensor, pdl: bool = True) -> None:
        r, k = down.shape
        n = up.shape[0]
        self.down, self.up = down, up
        self._interpret = interpreting()
        dt = down.dtype
        self.usable = (triton_available() and (down.is_cuda or self._interpret)
                       and dt in _DTYPES and up.dtype == dt and up.shape == (n, r)
                       and up.device == down.device and down.stride(1) == 1
                       and up.stride(1) == 1 and 0 < r <= _MAX_R and n > 0 and k > 0
                       # every int argument a 32-bit one, as bound (x's row stride: per call)
                       and max(down.stride(0), up.stride(0), k, n) <= _INT32_MAX)
        self._k, self._n, self._r, self._dtype = k, n, r, dt
        self._device = down.get_device()
        self._sd, self._su = down.stride(0), up.stride(0)
        self._down_aligned = _rows_aligned(down, self._sd)
        self._up_aligned = r % 16 == 0 and _rows_aligned(up, self._su)
        self._torch_device = down.device
        self._pdl = pdl and down.is_cuda and dependent_launch(self._device)
        self._adds: dict[tuple[int, bool], tuple[_AddLaunch, BoundLaunch]] = {}  # (BT, ALIGNED)
        # the weight and bias the linear launches are bound for, and those launches
        self._operands: LayerOperands | None = None
        # the weight's row alignment and the linear kernels' configuration (set by _take)
        self._w_aligned = False
        self._config: DecodeConfig | None = None
        self._linears: dict[tuple[int, bool], tuple[_LinearLaunch, BoundLaunch, BoundLaunch]] \
            = {}

    def add(self, out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
            capturing: bool | None = None) -> torch.Tensor:
        """``lora_decode_add(out, x, down, up, scale)`` for a contiguous ``out`` (..., N) and
        ``x`` (..., K) of at most :data:`DECODE_MAX_T` rows: in place, ``out`` returned.
        ``capturing``: whether a CUDA graph is being captured on the current stream, where the
        caller asked already (None: asked here).
        """
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        out2 = out if out.dim() == 2 else out.view(-1, out.shape[-1])
        if not self._bound_add(out2, x2, scale, capturing):
            lora_decode_add(out2, x2, self.down, self.up, scale)
        return out

    def _bound_add(self, out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
                   capturing: bool | None) -> bool:
        """:meth:`add` by the bound launch; False (nothing done) where it does not apply."""
        if not self.usable:
            return False
        k, n = self._k, self._n
        t = x.shape[0]
        if (t == 0 or t > DECODE_MAX_T or x.dtype != self._dtype or out.dtype != self._dtype
                or x.shape[1] != k or out.shape[0] != t or out.shape[1] != n
                or x.stride(1) != 1 or out.stride(1) != 1 or x.get_device() != self._device
                or out.get_device() != self._device or not self._scale_ok(scale)):
            return False
        sx, so = x.stride(0), out.stride(0)
        if sx > _INT32_MAX or so > _INT32_MAX:
            return False
        aligned = (k % 16 == 0 and n % 16 == 0 and self._down_aligned
                   and _rows_aligned(x, sx) and _rows_aligned(out, so))
        key = (max(16, next_power_of_2(t)), aligned)
        bound = self._adds.get(key)
        if bound is None:
            plan = _add_launch(t, k, n, self._r, _ADD_BLOCK_N, self._interpret, aligned,
                               self._up_aligned)
            bound = self._adds[key] = (plan, decode_kernels()[0].bind(plan.grid,
                                                                      **plan.constexprs))
        plan, launch = bound
        sem, ws = launch_scratch(self._torch_device, plan.floats, capturing)
        with on_device_of(x):
            launch(x, self.down, self.up, scale, ws, sem, out, t, k, n, self._r, plan.per,
                   plan.n_out, sx, self._sd, self._su, so)
        return True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               scale: torch.Tensor) -> torch.Tensor:
        """``lora_decode_linear(x, weight, bias, down, up, scale)`` (its default
        configuration) for ``x`` (T, K) of at most :data:`DECODE_MAX_T` rows.
        """
        out = self._bound_linear(x, weight, bias, scale)
        if out is None:
            out = lora_decode_linear(x, weight, bias, self.down, self.up, scale)
        return out

    def _bound_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      scale: torch.Tensor) -> torch.Tensor | None:
        """:meth:`linear` by the bound launches; None where they do not apply (the kernels do
        not take the operands, or autograd records).
        """
        if not self.usable:
            return None
        if (self._operands is None or not self._operands.fits(weight, bias)) \
                and not self._take(weight, bias):
            return None
        k = self._k
        t = x.shape[0]
        if (x.dim() != 2 or t == 0 or t > DECODE_MAX_T or x.dtype != self._dtype
                or x.shape[1] != k or x.stride(1) != 1 or x.stride(0) > _INT32_MAX
                or x.get_device() != self._device or not self._scale_ok(scale)
                or (torch.is_grad_enabled() and (
                    x.requires_grad or weight.requires_grad or self.down.requires_grad
                    or self.up.requires_grad or (bias is not None and bias.requires_grad)))):
            return None
        x_aligned = k % 16 == 0 and _rows_aligned(x, x.stride(0))
        key = (max(16, next_power_of_2(t)), x_aligned)
        bound = self._linears.get(key)
        if bound is None:
            plan = _linear_launch(t, k, self._n, self._r, self._config, self._interpret,
                                  x_aligned, self._down_aligned, self._w_aligned,
                                  bias is not None, self._pdl)
            _, output, shrink = decode_kernels()
            bound = self._linears[key] = (plan, shrink.bind((plan.parts,), **plan.shrink),
                                          output.bind(plan.grid, **plan.output))
        out = torch.empty(t, self._n, dtype=x.dtype, device=x.device)
        _launch_linear(bound[0], x, weight, bias, self.down, self.up, scale, out, bound[1],
                       bound[2])
        return out

    def _scale_ok(self, scale: torch.Tensor) -> bool:
        return (scale.dtype == torch.float32 and scale.dim() == 1
                and scale.shape[0] == self._r and scale.stride(0) == 1
                and scale.get_device() == self._device)

    def _take(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Bind the linear launches to ``weight`` and ``bias``; False where the kernels do not
        take them.
        """
        self._operands, self._linears = None, {}
        n, k = self._n, self._k
        if not (weight.dtype == self._dtype and weight.shape == (n, k) and weight.stride(1) == 1
                and weight.get_device() == self._device and weight.stride(0) <= _INT32_MAX
                and (bias is None or (bias.dtype == self._dtype and bias.shape == (n,)
                                      and bias.stride(0) == 1
                                      and bias.get_device() == self._device))):
            return False
        self._operands = LayerOperands(weight, bias)
        # the output is fresh and contiguous: its rows are aligned where N's are
        self._w_aligned = n % 16 == 0 and _rows_aligned(weight, weight.stride(0))
        self._config = _INTERPRET_LINEAR_CONFIG if self._interpret else _decode_config(
            n, weight.device)
        return True


_ADD_BLOCK_N = 64  # lora_decode_add's default columns per program
_INT32_MAX = 0x7FFFFFFF
