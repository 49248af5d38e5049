"""TMA support checks: addressability and Triton's workspace allocator."""

from __future__ import annotations

import contextvars

import pytest
import torch

from shuttle.kernels import triton_available
from shuttle.kernels.tma import ensure_allocator, tma_addressable

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


def test_cpu_tensors_are_not_tma_addressable():
    assert not tma_addressable(torch.zeros(16, 16, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_alignment_rules_on_cuda():
    ok = torch.zeros(32, 64, dtype=torch.bfloat16, device="cuda")
    assert tma_addressable(ok) == (torch.cuda.get_device_capability() >= (9, 0))
    assert not tma_addressable(ok[:, 1:])  # start not 16-byte aligned
    assert not tma_addressable(torch.zeros(32, 63, dtype=torch.bfloat16, device="cuda"))
    assert not tma_addressable(ok.T)  # no unit column stride


def _allocator_after(preset):
    import triton
    from triton.runtime._allocation import _allocator

    if preset is not None:
        triton.set_allocator(preset)
    ensure_allocator()
    return _allocator.get()


def test_installs_an_allocator_only_where_none_is_set():
    from triton.runtime._allocation import NullAllocator

    def mine(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8)

    # Fresh contexts: Triton keeps its allocator in a context variable.
    got = contextvars.Context().run(_allocator_after, None)
    assert not isinstance(got, NullAllocator)
    assert got(64, 16, None).numel() == 64
    assert contextvars.Context().run(_allocator_after, mine) is mine
