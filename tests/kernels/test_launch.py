"""The kernels' shared host helpers: grid arithmetic against Triton's, seeds, device constants."""

from __future__ import annotations

import pytest
import torch

from shuttle.kernels import launch


@pytest.mark.parametrize("n", [0, 1, 2, 3, 15, 16, 17, 1000, 4096, 4097])
def test_grid_arithmetic_matches_triton(n):
    triton = pytest.importorskip("triton")
    for b in (1, 16, 64, 128):
        assert launch.cdiv(n, b) == triton.cdiv(n, b)
    if n >= 1:
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n)


def test_seed32_folds_both_halves_into_32_bits():
    assert launch.seed32(5) == 5
    assert launch.seed32((5 << 32) | 7) == 5 ^ 7
    assert 0 <= launch.seed32(2**63 - 1) < 2**32
    assert launch.seed32(2**40) != launch.seed32(2**41)  # the high half matters


def test_device_floats_on_the_cpu_are_fresh_float32_tensors():
    a = launch.device_floats([0.5, -1.25], torch.device("cpu"))
    assert a.dtype == torch.float32 and a.tolist() == [0.5, -1.25]
    assert launch.device_floats([0.5, -1.25], torch.device("cpu")) is not a


@pytest.mark.gpu
def test_device_floats_on_cuda_are_cached_by_value():
    dev = torch.device("cuda", torch.cuda.current_device())
    a = launch.device_floats([0.375], dev)
    assert a.device == dev and a.tolist() == [0.375]
    assert launch.device_floats([0.375], dev) is a
    b = launch.device_floats([0.375, 2.0], dev)
    assert b is not a and b.tolist() == [0.375, 2.0]


@pytest.mark.gpu
def test_device_capability_is_the_drivers_answer_once_per_device():
    index = torch.cuda.current_device()
    assert launch.device_capability(index) == torch.cuda.get_device_capability(index)
    assert launch.device_capability(torch.device("cuda", index)) == launch.device_capability(index)


@pytest.mark.gpu
def test_sm_count_is_the_devices():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    props = torch.cuda.get_device_properties(0)
    assert launch.sm_count(0) == props.multi_processor_count
