"""float8 -> bfloat16/float16/float32 by the hardware's conversion instructions.

PyTorch's ``Tensor.to`` converts float8 element by element in software (decoding sign,
exponent and mantissa with integer ops): where a float8 model's weights are cast on every step,
that costs several times what the hardware conversion does (docs/benchmarks.md, "Quantized
weights").
:func:`upcast` is one Triton kernel that loads the codes, converts them with the GPU's float8
conversion and stores the result: a bandwidth-bound copy.
Every float8 value is exactly representable in the three outputs, so the result equals
``x.to(dtype)`` bit for bit. Off CUDA (and without Triton) it is ``x.to(dtype)``.
"""

from __future__ import annotations

import functools

import torch

from shuttle.kernels.launch import (
    cdiv,
    device_capability,
    interpreting,
    triton_available,
)

__all__ = ["upcast"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = 4096  # elements per program: 4 KiB of codes, 8 KiB of bf16 out


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def upcast_kernel(x_ptr, o_ptr, n, E5M2: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        if E5M2:  # e5m2 is the top byte of float16 (x_ptr holds the codes as uint8): exact
            # for every code, subnormals, infinities and NaNs included, on any backend
            x = (x.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
        tl.store(o_ptr + offs, x.to(o_ptr.dtype.element_ty), mask=mask)

    return upcast_kernel


def upcast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` for a float8 ``x`` and a bfloat16/float16/float32 ``dtype``, as a new
    tensor, by the kernel on CUDA (contiguous ``x``, sm89 or newer); any other input goes
    through ``x.to(dtype)``.
    """
    if (x.dtype not in _FP8 or dtype not in _OUT or not triton_available()
            or not x.is_contiguous() or x.numel() == 0
            or not (x.is_cuda or interpreting())
            or (x.is_cuda and device_capability(x.device) < (8, 9))):
        return x.to(dtype)

    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = x.numel()
    e5m2 = x.dtype == torch.float8_e5m2
    codes = x.detach().view(torch.uint8) if e5m2 else x.detach()
    _kernel()[(cdiv(n, _BLOCK),)](codes, out, n, E5M2=e5m2, BLOCK=_BLOCK)
    return out
