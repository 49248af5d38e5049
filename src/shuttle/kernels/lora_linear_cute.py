"""The fused LoRA linear's second kernel as the CuTe-DSL Hopper GEMM, for one layer.

:class:`CuteLoraGemm` launches :mod:`shuttle.kernels.lora_gemm_sm90`'s compiled program with raw
pointers and sizes (no per-call layout checks or DLPack conversion), through Apache TVM FFI's C
calling convention where ``apache-tvm-ffi`` is installed (the ``hopper`` extra brings it: the
DSL's own Python launcher converts every argument in Python, which costs an eager model more
host time per layer than the GEMM saves on the GPU);
:class:`~shuttle.kernels.lora_linear_tma.PreparedLoraLinear` runs it after the Triton shrink.
:func:`cute_available` says whether the DSL (``pip install "shuttle[hopper]"``) can be imported
and the device is a Hopper (sm_90) GPU; the Triton kernels serve everywhere else.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable
from typing import Any

import torch

from shuttle.kernels.lora_gemm_sm90 import (
    CUTE_DTYPES,
    CUTE_TILES,
    CuteTile,
    compile_lora_gemm,
    dsl,
    numeric,
)

__all__ = ["CuteLoraGemm", "cute_available", "cute_installed", "shrink_groups",
           "tvm_ffi_installed"]


def cute_installed() -> bool:
    """Whether the CuTe DSL's wheel (``pip install "shuttle[hopper]"``) is installed (found,
    not imported: importing the DSL takes about a second).
    """
    return importlib.util.find_spec("nvidia_cutlass_dsl") is not None


def cute_available(device: torch.device | int | None = None) -> bool:
    """Whether the CuTe kernel can run on ``device``: the DSL installed and a CUDA device of
    compute capability 9.0 (Hopper; the kernel's wgmma and TMA forms are sm_90's).
    """
    if not torch.cuda.is_available():
        return False
    if isinstance(device, int):  # the per-call form (x.get_device()): no device object made
        return _available_on(device)
    device = torch.device(device or "cuda")
    return _available_on(device.index if device.index is not None else
                         torch.cuda.current_device())


@functools.cache
def _available_on(index: int) -> bool:
    return cute_installed() and torch.cuda.get_device_capability(index) == (9, 0)


class CuteLoraGemm:
    """``out = x @ W.T + S @ B.T + bias`` by the CuTe kernel for one layer's shape and factors
    (checked once here; a call checks nothing but takes its operands as given).

    Given the down factor A (``down``), the kernel computes ``S = (x @ A.T) * scale`` itself
    (the shrink in the GEMM's work units, :mod:`~shuttle.kernels.lora_gemm_sm90`) and a call
    passes the per-rank ``scale``; without it a call passes S, computed beforehand.

    The bias and the scale are read from float32 copies padded to whole column tiles, refreshed
    when the caller's tensor is another one or was written in place (its version counter).

    Args:
        weight: W (N, K), bfloat16 or float16, contiguous, on a Hopper GPU (its shape and dtype
            are what this is built for; the call passes the weight itself).
        up: B (N, R), W's dtype, contiguous.
        has_bias: whether calls pass a bias.
        tile: the CTA tile (:data:`CUTE_TILES`).
        down: A (R, K), W's dtype, contiguous: the kernel computes S.

    Raises:
        ValueError: operands the kernel does not take (another dtype or device, sizes not a
            multiple of 8, non-contiguous rows); check :meth:`supports` first.
    """

    def __init__(self, weight: torch.Tensor, up: torch.Tensor, has_bias: bool,
                 tile: CuteTile = CUTE_TILES[0], down: torch.Tensor | None = None) -> None:
        if not self.supports(weight, up, down):
            shapes = f", A {tuple(down.shape)} {down.dtype}" if down is not None else ""
            raise ValueError(
                f"the CuTe LoRA kernel takes contiguous 16-bit W (N, K), B (N, R) and A (R, K) "
                f"on one CUDA device with N, K, R multiples of 8; got W {tuple(weight.shape)} "
                f"{weight.dtype}, B {tuple(up.shape)} {up.dtype}{shapes}")
        self.up, self.down, self.tile, self.m, self.n = up, down, tile, tile.m, tile.n
        self.shrink = down is not None
        n, k = weight.shape
        r = up.shape[1]
        self._shape = (n, k, r)
        device = weight.device
        self._bias = torch.zeros(-(-n // tile.n) * tile.n, dtype=torch.float32,
                                 device=device) if has_bias else None
        self._bias_of: tuple = ()  # (data_ptr, version) of the bias copied into self._bias
        s_jobs = -(-r // tile.n)
        self._scale = torch.zeros(s_jobs * tile.n, dtype=torch.float32,
                                  device=device) if self.shrink else None
        self._scale_of: tuple = ()
        # An operand the form does not read still needs an address: B's.
        self._spare = up.data_ptr()
        self._fixed: tuple | None = None  # (weight address, the fixed operands' DSL pointers)
        self._sms = torch.cuda.get_device_properties(device).multi_processor_count
        # With TVM FFI the program is a C function taking addresses, sizes and the stream
        # handle as Python ints (no DSL pointer objects, no Python-side argument packing).
        self._build = (weight.dtype, tile, has_bias, self._sms, self.shrink)
        self._ffi = _ffi_function(*self._build)
        self._compiled = None if self._ffi is not None else self._compile()
        d = dsl()
        self._elem, self._f32 = numeric(weight.dtype), d.cutlass.Float32
        self._ptr = functools.partial(d.make_ptr, mem_space=d.cute.AddressSpace.gmem,
                                      assumed_align=16)
        from cuda.bindings import driver

        self._stream_type = driver.CUstream

    def _compile(self) -> Any:
        dtype, tile, has_bias, sms, shrink = self._build
        return compile_lora_gemm(dtype, tile, has_bias, sms, shrink=shrink)

    @staticmethod
    def supports(weight: torch.Tensor, up: torch.Tensor, down: torch.Tensor | None = None
                 ) -> bool:
        """Whether W, B (and A) are operands the kernel takes (see the class docstring)."""
        factors = (up,) if down is None else (up, down)
        return (weight.dim() == 2 and up.dim() == 2 and weight.dtype in CUTE_DTYPES
                and weight.is_cuda and weight.is_contiguous()
                and all(f.dtype == weight.dtype and f.device == weight.device
                        and f.is_contiguous() and f.data_ptr() % 16 == 0 for f in factors)
                and up.shape[0] == weight.shape[0]
                and (down is None or down.shape == (up.shape[1], weight.shape[1]))
                and all(s % 8 == 0 for s in (*weight.shape, up.shape[1]))
                and weight.data_ptr() % 16 == 0)

    def groups(self, t: int) -> int:
        """Work units per row tile for ``t`` rows (the shrink form; 1 column tile each
        otherwise): see :func:`shrink_groups`.
        """
        n, k, r = self._shape
        tiles_n = -(-n // self.n)
        if not self.shrink:
            return tiles_n
        return shrink_groups(-(-t // self.m), tiles_n, -(-k // self.tile.k),
                             -(-r // self.tile.k), -(-r // self.n), self._sms)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 operand: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write ``x @ weight.T + S @ B.T + bias`` into ``out`` (T, N) on the current stream.

        ``operand``: S (T, R), the shrink's output; with the shrink form (built with ``down``)
        the float32 per-rank ``scale`` (R,) instead, ``S = (x @ A.T) * scale``.

        ``x`` (T, K), S and ``out`` contiguous, ``weight`` of the shape and layout this was
        built for, all of W's dtype and device and 16-byte aligned (the caller checks: nothing
        is checked here); ``bias`` (N,) where built with one.
        """
        n, k, r = self._shape
        t = x.shape[0]
        if self._bias is not None:
            self._bias_of = _refresh(self._bias, bias, self._bias_of)
        if self.shrink:
            self._scale_of = _refresh(self._scale, operand, self._scale_of)
            groups = self.groups(t)
            s = torch.empty(groups * -(-t // self.m) * self.m, r, dtype=x.dtype,
                            device=x.device)
            scale_addr = self._scale.data_ptr()
        else:
            groups, s, scale_addr = self.groups(t), operand, self._spare
        bias_addr = self._bias.data_ptr() if self._bias is not None else self._spare
        down_addr = self.down.data_ptr() if self.down is not None else self._spare
        stream = torch.cuda.current_stream(x.device).cuda_stream
        if self._ffi is not None:
            try:
                self._ffi(x.data_ptr(), weight.data_ptr(), down_addr, s.data_ptr(),
                          self.up.data_ptr(), scale_addr, bias_addr, out.data_ptr(), t, n, k,
                          r, groups, stream)
                return out
            except Exception as e:  # arguments refused before any launch: an FFI version
                self._fall_back(e)  # the DSL's program does not take; its own launcher then
        # The fixed operands' pointers are made once (a DSL pointer costs microseconds of host
        # time), again when the weight's storage moves (an offloaded layer's slot).
        ptr, elem, f32 = self._ptr, self._elem, self._f32
        if self._fixed is None or self._fixed[0] != weight.data_ptr():
            self._fixed = (weight.data_ptr(), ptr(elem, weight.data_ptr()),
                           ptr(elem, down_addr), ptr(elem, self.up.data_ptr()),
                           ptr(f32, scale_addr), ptr(f32, bias_addr))
        _, w_ptr, a_ptr, u_ptr, scale_ptr, bias_ptr = self._fixed
        self._compiled(
            ptr(elem, x.data_ptr()), w_ptr, a_ptr, ptr(elem, s.data_ptr()), u_ptr, scale_ptr,
            bias_ptr, ptr(elem, out.data_ptr()), t, n, k, r, groups, self._stream_type(stream))
        return out

    def _fall_back(self, error: Exception) -> None:
        warnings.warn(f"the CuTe LoRA kernel's TVM FFI launch failed ({type(error).__name__}: "
                      f"{error}); it launches through the DSL's own launcher from now on (more "
                      "host time per call): uninstall apache-tvm-ffi, or install the version "
                      "the DSL was built with", RuntimeWarning, stacklevel=3)
        self._ffi = None
        self._compiled = self._compile()


def _refresh(padded: torch.Tensor, source: torch.Tensor, seen: tuple) -> tuple:
    """Copy ``source`` into the head of its padded float32 copy unless it is the tensor, at the
    version, last copied (``seen``); the (data_ptr, version) now copied.
    """
    try:
        now = (source.data_ptr(), source._version)
    except RuntimeError:  # an inference tensor keeps no version: copy every call
        now = ()
    if not now or now != seen:
        padded[:source.shape[0]].copy_(source)
    return now


@functools.lru_cache(maxsize=256)
def shrink_groups(m_blocks: int, tiles_n: int, k_tiles: int, r_tiles: int, s_jobs: int,
                  sms: int) -> int:
    """How many work units share one row tile's column tiles in the shrink form.

    Each unit computes its rows' S (``s_jobs`` tiles of ``k_tiles`` steps) before its column
    tiles (``k_tiles + r_tiles`` steps each), so more units per row tile repeat the shrink; fewer
    leave SMs idle in the last round. The count minimizes rounds x steps per unit (the longest
    SM's work), the fewest units on a tie, every unit keeping at least one column tile.
    """
    def cost(g: int) -> tuple[int, int]:
        per = -(-tiles_n // g)
        return -(-(m_blocks * g) // sms) * (per * (k_tiles + r_tiles) + s_jobs * k_tiles), g

    best = min(range(1, tiles_n + 1), key=cost)
    return -(-tiles_n // -(-tiles_n // best))  # units that all keep a column tile


TVM_FFI_OPTION = "--enable-tvm-ffi"


def tvm_ffi_installed() -> bool:
    """Whether Apache TVM FFI (``apache-tvm-ffi``, in the ``hopper`` extra) is installed: the
    CuTe kernel is then compiled with ``--enable-tvm-ffi`` and launched through it.
    """
    return importlib.util.find_spec("tvm_ffi") is not None


def _ffi_function(dtype: torch.dtype, tile: CuteTile, has_bias: bool, sms: int,
                  shrink: bool) -> Callable[..., Any] | None:
    """The C-level TVM FFI function of the program compiled with :data:`TVM_FFI_OPTION` (it
    takes pointers as integer addresses and the stream as its integer handle), or None where
    TVM FFI is not installed or gives no function (then the DSL's own launcher serves).
    """
    if not tvm_ffi_installed():
        return None
    compiled = compile_lora_gemm(dtype, tile, has_bias, sms, TVM_FFI_OPTION, shrink)
    get = getattr(compiled, "__tvm_ffi_object__", None)
    return get() if get is not None else None
