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


class _Param:
    def __init__(self, name):
        self.name = name


class _Compiled:
    """A compiled kernel's launcher, as Triton's ``CompiledKernel[grid](*args, stream=)``."""

    def __init__(self, calls, fail=False):
        self.calls, self.fail = calls, fail

    def __getitem__(self, grid):
        if self.fail:
            raise TypeError("this Triton launches differently")
        return lambda *args, stream=None: self.calls.append(("direct", grid, args, stream))


class _Kernel:
    """A JIT kernel: ``kernel[grid](*args, **kwargs)`` launches and returns its compiled form."""

    def __init__(self, names, fail=False):
        self.params = [_Param(n) for n in names]
        self.calls, self.fail = [], fail

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("jit", grid, args, kwargs))
            return _Compiled(self.calls, self.fail)
        return run


@pytest.fixture
def compiled_mode(monkeypatch):
    """As on a GPU: no interpreter, a current device and stream (none exist on the CPU)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a: type("S", (), {"cuda_stream": 1234})())


def test_compiled_launch_goes_direct_after_the_first_launch(compiled_mode):
    k = _Kernel(["x", "n", "BLOCK", "FLAG"])
    run = launch.CompiledLaunch(k)
    x = torch.zeros(8)
    run((4,), x, 32, BLOCK=16, FLAG=True, num_warps=4)
    run((5,), x, 32, BLOCK=16, FLAG=True, num_warps=4)
    assert [c[0] for c in k.calls] == ["jit", "direct"]
    # every argument in the kernel's parameter order (options are not parameters), 3-d grid
    assert k.calls[1][1:] == ((5, 1, 1), (x, 32, 16, True), 1234)


@pytest.mark.parametrize("change", ["dtype", "alignment", "int", "constexpr", "option"])
def test_compiled_launch_specializes_as_triton_does(compiled_mode, change):
    k = _Kernel(["x", "n", "BLOCK"])
    run = launch.CompiledLaunch(k)
    base = torch.zeros(64)
    args, kw = [base, 32], {"BLOCK": 16, "num_warps": 4}
    run((1,), *args, **kw)
    if change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "alignment":
        args[0] = base[1:]  # 4 bytes past a 16-byte boundary
    elif change == "int":
        args[1] = 33  # no longer a multiple of 16
    elif change == "constexpr":
        kw["BLOCK"] = 32
    else:
        kw["num_warps"] = 8
    run((1,), *args, **kw)
    assert [c[0] for c in k.calls] == ["jit", "jit"]  # a new specialization: the JIT again
    run((1,), *args, **kw)
    assert k.calls[-1][0] == "direct"


def test_compiled_launch_falls_back_for_good_when_direct_calls_fail(compiled_mode):
    k = _Kernel(["x", "BLOCK"], fail=True)
    run = launch.CompiledLaunch(k)
    x = torch.zeros(8)
    for _ in range(3):
        run((1,), x, BLOCK=16)
    assert [c[0] for c in k.calls] == ["jit", "jit", "jit"]
    assert not run._direct


def test_compiled_launch_under_the_interpreter_always_uses_the_jit(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = _Kernel(["x", "BLOCK"])
    run = launch.CompiledLaunch(k)
    for _ in range(2):
        run((1,), torch.zeros(8), BLOCK=16)
    assert [c[0] for c in k.calls] == ["jit", "jit"]
