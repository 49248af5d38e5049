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

__all__ = ["CuteLoraGemm", "cute_available", "cute_installed", "tvm_ffi_installed"]


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
    """``out = x @ W.T + S @ B.T + bias`` by the CuTe kernel for one layer's shape and factor B
    (checked once here; a call checks nothing but takes its operands as given).

    The bias is added from a float32 copy padded to whole column tiles, refreshed when the
    layer's bias is another tensor or was written in place (its version counter).

    Args:
        weight: W (N, K), bfloat16 or float16, contiguous, on a Hopper GPU (its shape and dtype
            are what this is built for; the call passes the weight itself).
        up: B (N, R), W's dtype, contiguous.
        has_bias: whether calls pass a bias.
        tile: the CTA tile (:data:`CUTE_TILES`).

    Raises:
        ValueError: operands the kernel does not take (another dtype or device, sizes not a
            multiple of 8, non-contiguous rows); check :meth:`supports` first.
    """

    def __init__(self, weight: torch.Tensor, up: torch.Tensor, has_bias: bool,
                 tile: CuteTile = CUTE_TILES[0]) -> None:
        if not self.supports(weight, up):
            raise ValueError(
                f"the CuTe LoRA kernel takes contiguous 16-bit W (N, K) and B (N, R) on one "
                f"CUDA device with N, K, R multiples of 8; got W {tuple(weight.shape)} "
                f"{weight.dtype}, B {tuple(up.shape)} {up.dtype}")
        self.up, self.tile, self.m, self.n = up, tile, tile.m, tile.n
        self._shape = (*weight.shape, up.shape[1])  # N, K, R
        self._bias = torch.zeros(-(-weight.shape[0] // tile.n) * tile.n, dtype=torch.float32,
                                 device=weight.device) if has_bias else None
        self._bias_of: tuple = ()  # (data_ptr, version) of the bias copied into self._bias
        self._fixed: tuple | None = None  # (weight address, its, B's and the bias's pointers)
        sms = torch.cuda.get_device_properties(weight.device).multi_processor_count
        # With TVM FFI the program is a C function taking addresses, sizes and the stream
        # handle as Python ints (no DSL pointer objects, no Python-side argument packing).
        self._build = (weight.dtype, tile, has_bias, sms)
        self._ffi = _ffi_function(*self._build)
        self._compiled = None if self._ffi is not None else compile_lora_gemm(*self._build)
        d = dsl()
        self._elem, self._f32 = numeric(weight.dtype), d.cutlass.Float32
        self._ptr = functools.partial(d.make_ptr, mem_space=d.cute.AddressSpace.gmem,
                                      assumed_align=16)
        from cuda.bindings import driver

        self._stream_type = driver.CUstream

    @staticmethod
    def supports(weight: torch.Tensor, up: torch.Tensor) -> bool:
        """Whether W and B are operands the kernel takes (see the class docstring)."""
        return (weight.dim() == 2 and up.dim() == 2 and weight.dtype in CUTE_DTYPES
                and up.dtype == weight.dtype and weight.is_cuda and up.device == weight.device
                and weight.is_contiguous() and up.is_contiguous()
                and up.shape[0] == weight.shape[0]
                and all(s % 8 == 0 for s in (*weight.shape, up.shape[1]))
                and weight.data_ptr() % 16 == 0 and up.data_ptr() % 16 == 0)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 s: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write ``x @ weight.T + s @ B.T + bias`` into ``out`` (T, N) on the current stream.

        ``x`` (T, K), ``s`` (T, R) and ``out`` contiguous, ``weight`` of the shape and layout
        this was built for, all of W's dtype and device and 16-byte aligned (the caller checks:
        nothing is checked here); ``bias`` (N,) where built with one.
        """
        n, k, r = self._shape
        ptr, elem = self._ptr, self._elem
        if self._bias is not None:
            try:
                seen = (bias.data_ptr(), bias._version)
            except RuntimeError:  # an inference tensor keeps no version: copy every call
                seen = ()
            if not seen or seen != self._bias_of:
                self._bias[:n].copy_(bias)
                self._bias_of = seen
        stream = torch.cuda.current_stream(x.device).cuda_stream
        if self._ffi is not None:
            bias_addr = self._bias.data_ptr() if self._bias is not None else self.up.data_ptr()
            try:
                self._ffi(x.data_ptr(), weight.data_ptr(), s.data_ptr(), self.up.data_ptr(),
                          bias_addr, out.data_ptr(), x.shape[0], n, k, r, stream)
                return out
            except Exception as e:  # arguments refused before any launch: an FFI version
                self._fall_back(e)  # the DSL's program does not take; its own launcher then
        # The fixed operands' pointers are made once (a DSL pointer costs microseconds of host
        # time), again when the weight's storage moves (an offloaded layer's slot).
        if self._fixed is None or self._fixed[0] != weight.data_ptr():
            bias_ptr = self._bias.data_ptr() if self._bias is not None else self.up.data_ptr()
            self._fixed = (weight.data_ptr(), ptr(elem, weight.data_ptr()),
                           ptr(elem, self.up.data_ptr()), ptr(self._f32, bias_ptr))
        _, w_ptr, u_ptr, bias_ptr = self._fixed
        self._compiled(
            ptr(elem, x.data_ptr()), w_ptr, ptr(elem, s.data_ptr()), u_ptr, bias_ptr,
            ptr(elem, out.data_ptr()), x.shape[0], n, k, r, self._stream_type(stream))
        return out

    def _fall_back(self, error: Exception) -> None:
        warnings.warn(f"the CuTe LoRA kernel's TVM FFI launch failed ({type(error).__name__}: "
                      f"{error}); it launches through the DSL's own launcher from now on (more "
                      "host time per call): uninstall apache-tvm-ffi, or install the version "
                      "the DSL was built with", RuntimeWarning, stacklevel=3)
        self._ffi = None
        self._compiled = compile_lora_gemm(*self._build)


TVM_FFI_OPTION = "--enable-tvm-ffi"


def tvm_ffi_installed() -> bool:
    """Whether Apache TVM FFI (``apache-tvm-ffi``, in the ``hopper`` extra) is installed: the
    CuTe kernel is then compiled with ``--enable-tvm-ffi`` and launched through it.
    """
    return importlib.util.find_spec("tvm_ffi") is not None


def _ffi_function(dtype: torch.dtype, tile: CuteTile, has_bias: bool,
                  sms: int) -> Callable[..., Any] | None:
    """The C-level TVM FFI function of the program compiled with :data:`TVM_FFI_OPTION` (it
    takes pointers as integer addresses and the stream as its integer handle), or None where
    TVM FFI is not installed or gives no function (then the DSL's own launcher serves).
    """
    if not tvm_ffi_installed():
        return None
    compiled = compile_lora_gemm(dtype, tile, has_bias, sms, options=TVM_FFI_OPTION)
    get = getattr(compiled, "__tvm_ffi_object__", None)
    return get() if get is not None else None
