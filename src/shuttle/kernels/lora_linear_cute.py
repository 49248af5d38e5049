"""The fused LoRA linear's second kernel as the CuTe-DSL Hopper GEMM, for one layer.

:class:`CuteLoraGemm` launches :mod:`shuttle.kernels.lora_gemm_sm90`'s compiled program with raw
pointers and sizes (no per-call layout checks or DLPack conversion), through Apache TVM FFI's C
calling convention where ``apache-tvm-ffi`` is installed (the ``hopper`` extra brings it: the
DSL's own Python launcher converts every argument in Python, which costs an eager model more
host time per layer than the GEMM saves on the GPU);
:class:`~shuttle.kernels.lora_linear_tma.PreparedLoraLinear` runs it after the Triton shrink,
or alone where it computes S itself (its shrink form).
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

from shuttle.kernels.cute_dsl import CUTE_DTYPES, CUTE_TILES, CuteTile, dsl, numeric
from shuttle.kernels.launch import current_stream_handle
from shuttle.kernels.lora_gemm_sm90 import compile_lora_gemm
from shuttle.kernels.lora_gemm_units import WorkLists, s_tiles_ahead

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
    """``out = x @ W.T + S @ B.T + bias`` by the CuTe kernel for one layer's shape and factors
    (checked once here; a call checks nothing but takes its operands as given).

    Built with the down factor A (``down``, rank at most ``tile.m``), the kernel computes
    ``S = (x @ A.T) * scale`` itself (S tiles among its work units, each read by the output
    tiles of its rows once a flag says it is in memory:
    :mod:`~shuttle.kernels.lora_gemm_sm90`) and a call passes the per-rank ``scale``;
    without it a call passes S, computed beforehand.

    The bias and the scale are read from float32 copies padded to whole tiles, refreshed when
    the caller's tensor is another one or was written in place (its version counter). The
    shrink form's work lists and flags are the device's (:class:`~shuttle.kernels.
    lora_gemm_units.WorkLists`): its launches must follow one another, as one stream orders
    them (a model runs its layers on one stream).

    Args:
        weight: W (N, K), bfloat16 or float16, contiguous, on a Hopper GPU (its shape and dtype
            are what this is built for; the call passes the weight itself).
        up: B (N, R), W's dtype, contiguous.
        has_bias: whether calls pass a bias.
        tile: the CTA tile (:data:`CUTE_TILES`).
        down: A (R, K), W's dtype, contiguous: the kernel computes S.
        pdl: without ``down``, launch as a programmatic dependent of the kernel before it
            (``compile_lora_gemm``'s ``pdl``): x and W stream while that kernel, the one
            writing S, still runs. Every call must then come right after that kernel.

    Raises:
        ValueError: operands the kernel does not take (another dtype or device, sizes not a
            multiple of 8, non-contiguous rows, a rank over ``tile.m`` with ``down``); check
            :meth:`supports` first.
    """

    def __init__(self, weight: torch.Tensor, up: torch.Tensor, has_bias: bool,
                 tile: CuteTile = CUTE_TILES[0], down: torch.Tensor | None = None,
                 pdl: bool = False) -> None:
        if not self.supports(weight, up, down, tile):
            shapes = f", A {tuple(down.shape)} {down.dtype}" if down is not None else ""
            raise ValueError(
                f"the CuTe LoRA kernel takes contiguous 16-bit W (N, K), B (N, R) and A (R, K) "
                f"on one CUDA device with N, K, R multiples of 8 (R at most {tile.m} with A); "
                f"got W {tuple(weight.shape)} {weight.dtype}, B {tuple(up.shape)} "
                f"{up.dtype}{shapes}")
        self.up, self.down, self.tile, self.m, self.n = up, down, tile, tile.m, tile.n
        self.shrink = down is not None
        self.pdl = pdl and not self.shrink
        n, k = weight.shape
        self._shape = (n, k, up.shape[1])  # N, K, R
        device = weight.device
        self._bias = torch.zeros(-(-n // tile.n) * tile.n, dtype=torch.float32,
                                 device=device) if has_bias else None
        self._bias_of: tuple = ()  # (data_ptr, version) of the bias copied into self._bias
        self._scale = torch.zeros(tile.m, dtype=torch.float32,
                                  device=device) if self.shrink else None
        self._scale_of: tuple = ()
        self._spare = up.data_ptr()  # the address an operand the form does not read gets
        self._fixed: tuple | None = None  # (weight address, the fixed operands' DSL pointers)
        self._sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._lists = _work_lists(device) if self.shrink else None
        tiles_n = -(-n // tile.n)  # a list's shape but for its rows
        self._list_of = (tiles_n, tile.m, tile.n,
                         s_tiles_ahead(self._sms, tiles_n * tile.n / tile.m,
                                       tile.n * k * up.element_size()))
        # With TVM FFI the program is a C function taking addresses, sizes and the stream
        # handle as Python ints (no DSL pointer objects, no Python-side argument packing).
        self._build = (weight.dtype, tile, has_bias, self._sms, self.shrink, self.pdl)
        self._ffi = _ffi_function(*self._build)
        self._compiled = None if self._ffi is not None else self._compile()
        d = dsl()
        self._elem, self._f32, self._i32 = numeric(weight.dtype), d.cutlass.Float32, \
            d.cutlass.Int32
        self._ptr = functools.partial(d.make_ptr, mem_space=d.cute.AddressSpace.gmem,
                                      assumed_align=16)
        from cuda.bindings import driver

        self._stream_type = driver.CUstream

    def _compile(self) -> Any:
        dtype, tile, has_bias, sms, shrink, pdl = self._build
        return compile_lora_gemm(dtype, tile, has_bias, sms, shrink=shrink, pdl=pdl)

    @staticmethod
    def supports(weight: torch.Tensor, up: torch.Tensor, down: torch.Tensor | None = None,
                 tile: CuteTile = CUTE_TILES[0]) -> bool:
        """Whether W, B (and A) are operands the kernel takes (see the class docstring)."""
        factors = (up,) if down is None else (up, down)
        return (weight.dim() == 2 and up.dim() == 2 and weight.dtype in CUTE_DTYPES
                and weight.is_cuda and weight.is_contiguous()
                and all(f.dtype == weight.dtype and f.device == weight.device
                        and f.is_contiguous() and f.data_ptr() % 16 == 0 for f in factors)
                and up.shape[0] == weight.shape[0]
                and (down is None or (down.shape == (up.shape[1], weight.shape[1])
                                      and up.shape[1] <= tile.m))
                and all(s % 8 == 0 for s in (*weight.shape, up.shape[1]))
                and weight.data_ptr() % 16 == 0)

    def work_list(self, t: int, capturing: bool = False) -> tuple[torch.Tensor, int, int] | None:
        """The shrink form's work list for ``t`` rows, its units and its S tiles
        (:class:`~shuttle.kernels.lora_gemm_units.WorkLists`); None while ``capturing`` a CUDA
        graph where it was not made before (then call another path).
        """
        return self._lists.get(-(-t // self.m), *self._list_of, capturing=capturing)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 operand: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """Write ``x @ weight.T + S @ B.T + bias`` into ``out`` (T, N) on the current stream.

        ``operand``: S (T, R), the shrink's output; with the shrink form (built with ``down``)
        the float32 per-rank ``scale`` (R,) instead, ``S = (x @ A.T) * scale``.

        ``x`` (T, K), S and ``out`` contiguous, ``weight`` of the shape and layout this was
        built for, all of W's dtype and device and 16-byte aligned (the caller checks: nothing
        is checked here); ``bias`` (N,) where built with one. None, launching nothing, where
        the shrink form is called during a CUDA graph capture for a row count it has no work
        list for (none is made during a capture: run another path for that call).
        """
        n, k, r = self._shape
        t = x.shape[0]
        if self.shrink:
            got = self.work_list(t, torch.cuda.is_current_stream_capturing())
            if got is None:
                return None
            table, units, s_blocks = got
            self._scale_of = _refresh(self._scale, operand, self._scale_of)
            s = torch.empty(s_blocks * self.n, r, dtype=x.dtype, device=x.device)
            addrs = (self.down.data_ptr(), s.data_ptr(), self._scale.data_ptr(),
                     table.data_ptr(), self._lists.flags.data_ptr())
        else:
            units, s_blocks = -(-t // self.m) * -(-n // self.n), 1
            spare = self._spare
            addrs = (spare, operand.data_ptr(), spare, spare, spare)
        if self._bias is not None:
            self._bias_of = _refresh(self._bias, bias, self._bias_of)
        down_addr, s_addr, scale_addr, table_addr, flags_addr = addrs
        bias_addr = self._bias.data_ptr() if self._bias is not None else self._spare
        stream = current_stream_handle(x.get_device())
        if self._ffi is not None:
            try:
                self._ffi(x.data_ptr(), weight.data_ptr(), down_addr, s_addr,
                          self.up.data_ptr(), scale_addr, bias_addr, out.data_ptr(),
                          table_addr, flags_addr, t, n, k, r, units, s_blocks, stream)
                return out
            except Exception as e:  # arguments refused before any launch: an FFI version
                self._fall_back(e)  # the DSL's program does not take; its own launcher then
        # The fixed operands' pointers are made once (a DSL pointer costs microseconds of host
        # time), again when the weight's storage moves (an offloaded layer's slot).
        ptr, elem, f32, i32 = self._ptr, self._elem, self._f32, self._i32
        if self._fixed is None or self._fixed[0] != weight.data_ptr():
            self._fixed = (weight.data_ptr(), ptr(elem, weight.data_ptr()),
                           ptr(elem, down_addr), ptr(elem, self.up.data_ptr()),
                           ptr(f32, scale_addr), ptr(f32, bias_addr), ptr(i32, flags_addr))
        _, w_ptr, a_ptr, u_ptr, scale_ptr, bias_ptr, flags_ptr = self._fixed
        self._compiled(
            ptr(elem, x.data_ptr()), w_ptr, a_ptr, ptr(elem, s_addr), u_ptr, scale_ptr,
            bias_ptr, ptr(elem, out.data_ptr()), ptr(i32, table_addr), flags_ptr, t, n, k, r,
            units, s_blocks, self._stream_type(stream))
        return out

    def _fall_back(self, error: Exception) -> None:
        warnings.warn(f"the CuTe LoRA kernel's TVM FFI launch failed ({type(error).__name__}: "
                      f"{error}); it launches through the DSL's own launcher from now on (more "
                      "host time per call): uninstall apache-tvm-ffi, or install the version "
                      "the DSL was built with", RuntimeWarning, stacklevel=3)
        self._ffi = None
        self._compiled = self._compile()


@functools.cache
def _work_lists(device: torch.device) -> WorkLists:
    """The shrink form's work lists and flags of one device (shared by its layers)."""
    return WorkLists(device)


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


TVM_FFI_OPTION = "--enable-tvm-ffi"


def tvm_ffi_installed() -> bool:
    """Whether Apache TVM FFI (``apache-tvm-ffi``, in the ``hopper`` extra) is installed: the
    CuTe kernel is then compiled with ``--enable-tvm-ffi`` and launched through it.
    """
    return importlib.util.find_spec("tvm_ffi") is not None


def _ffi_function(dtype: torch.dtype, tile: CuteTile, has_bias: bool, sms: int,
                  shrink: bool, pdl: bool) -> Callable[..., Any] | None:
    """The C-level TVM FFI function of the program compiled with :data:`TVM_FFI_OPTION` (it
    takes pointers as integer addresses and the stream as its integer handle), or None where
    TVM FFI is not installed or gives no function (then the DSL's own launcher serves).
    """
    if not tvm_ffi_installed():
        return None
    compiled = compile_lora_gemm(dtype, tile, has_bias, sms, TVM_FFI_OPTION, shrink, pdl)
    get = getattr(compiled, "__tvm_ffi_object__", None)
    return get() if get is not None else None
