"""What the Hopper tensor memory accelerator (TMA) kernels need from their callers.

The kernels build their TMA descriptors on the device (``tl.make_tensor_descriptor``): building
them on the host costs tens of microseconds of Python and driver work per descriptor and launch,
which a kernel of ~100 us cannot hide. Device-side descriptors live in a small global workspace
that Triton asks its *allocator* for at launch; :func:`ensure_allocator` installs one backed by
PyTorch's caching allocator where none is set.
"""

from __future__ import annotations

import torch

from shuttle.kernels.launch import device_capability

__all__ = ["ensure_allocator", "tma_addressable"]


def tma_addressable(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these 2-D tensors: CUDA tensors on a device with a
    tensor memory accelerator (compute capability 9.0+), Triton with device-side descriptors
    (3.4+), 16-byte aligned starts and row strides, unit column stride.
    """
    if not all(t.is_cuda for t in tensors):
        return False
    if device_capability(tensors[0].device.index) < (9, 0):
        return False
    import triton.language as tl

    if not hasattr(tl, "make_tensor_descriptor"):
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.stride(1) == 1 for t in tensors)


def _workspace(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # The current device's caching allocator: freed when Triton drops it after the launch, so
    # the workspace is reused, not allocated anew on the device, in steady state.
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter
    return torch.empty(size, dtype=torch.int8, device=device)


def ensure_allocator() -> None:
    """Install :func:`_workspace` as Triton's allocator unless the caller set one.

    Triton keeps the allocator in a context variable, so this runs before every launch (a
    new thread starts without one); it is a lookup when one is set.
    """
    import triton

    try:
        from triton.runtime._allocation import NullAllocator, _allocator
    except ImportError:  # a layout we do not know: set ours
        triton.set_allocator(_workspace)
        return
    if isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_workspace)
