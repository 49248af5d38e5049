"""The kernels' shared host helpers: grid arithmetic against Triton's, seeds, device constants."""

from __future__ import annotations

import functools

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


def test_current_stream_handle_takes_the_public_query_where_the_raw_one_is_missing(monkeypatch):
    asked = []

    class Stream:
        cuda_stream = 0x1234

    monkeypatch.setattr(launch, "_RAW_STREAM", None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda i: asked.append(i) or Stream())
    assert launch.current_stream_handle(3) == 0x1234 and asked == [3]


def test_current_stream_handle_asks_the_raw_query_of_the_device_given(monkeypatch):
    asked = []
    monkeypatch.setattr(launch, "_RAW_STREAM", lambda i: asked.append(i) or 0x99)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda i: pytest.fail("public query"))
    assert launch.current_stream_handle(1) == 0x99 and asked == [1]


@pytest.mark.gpu
def test_current_stream_handle_is_the_current_streams_on_every_stream():
    index = torch.cuda.current_device()
    assert launch.current_stream_handle(index) == torch.cuda.current_stream(index).cuda_stream
    side = torch.cuda.Stream(index)
    with torch.cuda.stream(side):
        assert launch.current_stream_handle(index) == side.cuda_stream != 0
    assert launch.current_stream_handle(index) == torch.cuda.current_stream(index).cuda_stream


def test_on_device_of_switches_only_to_another_gpu(monkeypatch):
    class OnGpu:
        is_cuda = True

        def __init__(self, index):
            self.index = index

        def get_device(self):
            return self.index

    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda i: entered.append(i) or "switch")
    assert launch.on_device_of(torch.zeros(1)) is launch._NOTHING  # not a GPU tensor
    assert launch.on_device_of(OnGpu(0)) is launch._NOTHING and entered == []
    assert launch.on_device_of(OnGpu(1)) == "switch" and entered == [1]


class _Param:
    def __init__(self, name):
        self.name = name


class _FakeKernel:
    """Records launches the way Triton's JIT function and compiled kernel take them."""

    params = [_Param(n) for n in ("x", "n", "BLOCK", "MODE")]

    def __init__(self, fail_warmup=False, streamless=False):
        self.jit_calls, self.binary_calls, self.fail_warmup = [], [], fail_warmup
        self.launchers_made, self.streamless = [], streamless

    def __getitem__(self, grid):
        return lambda *args, **kw: self.jit_calls.append((grid, args, kw))

    def warmup(self, *args, grid, **kw):
        if self.fail_warmup:
            raise AttributeError("no compiled-kernel interface")
        calls, made, streamless = self.binary_calls, self.launchers_made, self.streamless

        class Binary:
            def __getitem__(self, g):
                made.append(g)
                if streamless:
                    return lambda *a: calls.append((g, a, None))
                return lambda *a, stream=None: calls.append((g, a, stream))

        return Binary()


@pytest.fixture
def on_gpu_zero(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "_RAW_STREAM", lambda i: 0x5000 + i)


def test_compiled_launch_reuses_the_binary_per_key(on_gpu_zero):
    k = _FakeKernel()
    run = launch.CompiledLaunch(k)
    x = torch.zeros(4)
    run((3,), x, 7, BLOCK=16, MODE=1, num_warps=4)
    assert len(k.jit_calls) == 1 and not k.binary_calls  # first launch: Triton's own path
    run((5,), x, 9, BLOCK=16, MODE=1, num_warps=4)
    # Later ones: the binary, grid padded to 3-D, constexprs appended in the kernel's order,
    # on the current stream of the current device.
    assert k.binary_calls == [((5, 1, 1), (x, 9, 16, 1), 0x5000)]
    assert len(k.jit_calls) == 1
    # Another dtype, constexpr or int width is another binary: Triton's path first again.
    run((5,), x.double(), 9, BLOCK=16, MODE=1, num_warps=4)
    run((5,), x, 9, BLOCK=32, MODE=1, num_warps=4)
    run((5,), x, 2**40, BLOCK=16, MODE=1, num_warps=4)
    assert len(k.jit_calls) == 4 and len(k.binary_calls) == 1
    run((5,), x, 2**41, BLOCK=16, MODE=1, num_warps=4)  # 64-bit again: that binary now
    assert len(k.binary_calls) == 2


def test_compiled_launch_makes_one_launcher_per_grid(on_gpu_zero, monkeypatch):
    k = _FakeKernel()
    run = launch.CompiledLaunch(k)
    x = torch.zeros(4)
    run((3,), x, 7, BLOCK=16, MODE=1)
    k.launchers_made.clear()  # the first launch's check of the binary
    for grid in [(3,), (3,), (5, 2), (3,), (5, 2)]:
        run(grid, x, 7, BLOCK=16, MODE=1)
    assert k.launchers_made == [(3, 1, 1), (5, 2, 1)]
    assert [c[0] for c in k.binary_calls] == [(3, 1, 1)] * 2 + [(5, 2, 1), (3, 1, 1), (5, 2, 1)]
    # each launch reads the stream then current, not the one current when its launcher was made
    monkeypatch.setattr(launch, "_RAW_STREAM", lambda i: 0x7000)
    run((3,), x, 7, BLOCK=16, MODE=1)
    assert k.binary_calls[-1][2] == 0x7000


def test_compiled_launch_keeps_few_launchers_for_grids_that_keep_changing(on_gpu_zero):
    k = _FakeKernel()
    run = launch.CompiledLaunch(k)
    x = torch.zeros(4)
    for g in range(launch._MAX_GRIDS + 10):
        run((g + 1,), x, 7, BLOCK=16, MODE=1)
    run((launch._MAX_GRIDS + 5,), x, 7, BLOCK=16, MODE=1)  # past the limit: made again
    assert len(k.launchers_made) == launch._MAX_GRIDS + 11  # the first launch's check + each
    assert len(k.binary_calls) == launch._MAX_GRIDS + 10


def test_compiled_launch_takes_tritons_path_for_launchers_without_a_stream(on_gpu_zero):
    k = _FakeKernel(streamless=True)
    run = launch.CompiledLaunch(k)
    x = torch.zeros(4)
    for _ in range(3):
        run((3,), x, 7, BLOCK=16, MODE=1)
    assert len(k.jit_calls) == 3 and not k.binary_calls and not run.direct


def test_compiled_launch_passes_on_a_launchers_own_type_errors(on_gpu_zero):
    k = _FakeKernel()
    run = launch.CompiledLaunch(k)
    x = torch.zeros(4)
    run((3,), x, 7, BLOCK=16, MODE=1)

    class Refusing:
        def __getitem__(self, g):
            def launcher(*a, stream=None):
                raise TypeError("expected an int for argument 2")
            return launcher

    (key, (_, tail, launchers)), = run._binaries.items()
    run._binaries[key] = (Refusing(), tail, launchers)
    with pytest.raises(TypeError, match="argument 2"):
        run((3,), x, 7, BLOCK=16, MODE=1)
    assert run.direct and len(k.jit_calls) == 1  # not sent down Triton's path for good


def test_compiled_launch_keeps_tritons_path_when_binaries_cannot_be_fetched(on_gpu_zero):
    k = _FakeKernel(fail_warmup=True)
    run = launch.CompiledLaunch(k)
    for _ in range(3):
        run((1,), torch.zeros(2), 1, BLOCK=16, MODE=0)
    assert len(k.jit_calls) == 3 and not k.binary_calls and not run.direct


def test_compiled_launch_under_the_interpreter_always_dispatches(on_gpu_zero, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = _FakeKernel()
    run = launch.CompiledLaunch(k)
    for _ in range(3):
        run((1,), torch.zeros(2), 1, BLOCK=16, MODE=0)
    assert len(k.jit_calls) == 3 and not k.binary_calls


def test_bound_launch_goes_direct_once_the_launcher_exists(on_gpu_zero, monkeypatch):
    k = _FakeKernel()
    bound = launch.CompiledLaunch(k).bind((3,), BLOCK=16, MODE=1, num_warps=4)
    x = torch.zeros(4)
    bound(x, 7)  # Triton's path (compiles)
    bound(x, 8)  # the binary's first direct launch: its launcher made
    assert len(k.jit_calls) == 1 and len(k.binary_calls) == 1
    # From now on straight to the launcher: no key is built from the arguments.
    monkeypatch.setattr(launch, "_key", lambda *a: pytest.fail("key built for a bound call"))
    monkeypatch.setattr(launch, "_RAW_STREAM", lambda i: 0x7000)
    bound(x, 9)
    assert k.binary_calls[-1] == ((3, 1, 1), (x, 9, 16, 1), 0x7000)  # the stream now current
    assert len(k.launchers_made) == 2  # the first launch's check, then the grid's launcher


def test_bound_launch_under_the_interpreter_always_dispatches(on_gpu_zero, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = _FakeKernel()
    bound = launch.CompiledLaunch(k).bind((1,), BLOCK=16, MODE=0)
    for _ in range(3):
        bound(torch.zeros(2), 1)
    assert len(k.jit_calls) == 3 and not k.binary_calls


def test_layer_operands_fit_the_same_tensors_as_laid_out():
    w, b = torch.zeros(4, 8), torch.zeros(4)
    held = launch.LayerOperands(w, b)
    assert held.fits(w, b) and held.get() == (w, b)
    assert not held.fits(w, None) and not held.fits(torch.zeros(4, 8), b)
    w.data = torch.zeros(4, 8)  # the same parameter object, new storage
    assert not held.fits(w, b)
    nobias = launch.LayerOperands(w, None)
    assert nobias.fits(w, None) and not nobias.fits(w, b)


def test_no_dependent_launch_off_a_compiled_gpu():
    """Under the interpreter (as on this CPU) no kernel asks to be launched early."""
    if not launch.interpreting():
        pytest.skip("kernels compiled here")
    assert launch.dependent_launch(0) is False


# What the kernels below call, bound from Triton when they are built (Triton resolves a kernel's
# calls among its module's globals).
gdc_launch_dependents = globaltimer = wait_for_primary = None


@functools.cache
def _late_copy_kernel():
    import triton
    import triton.language as tl
    from triton.language.extra import cuda

    globals().update(gdc_launch_dependents=cuda.gdc_launch_dependents,
                     globaltimer=cuda.globaltimer)

    @triton.jit
    def late_copy_kernel(src_ptr, dst_ptr, n, delay_ns, BLOCK: tl.constexpr):
        # lets its programmatic dependent start, waits delay_ns, then copies
        gdc_launch_dependents()
        start = globaltimer()
        now = start
        while now - start < delay_ns:
            now = globaltimer()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)

    return late_copy_kernel


def late_copy(src: torch.Tensor, dst: torch.Tensor, delay_s: float = 1e-3) -> None:
    """``dst.copy_(src)`` by a kernel that lets a kernel launched as its programmatic dependent
    start at once and writes ``delay_s`` later: a dependent reading ``dst`` before it waits for
    its primary reads what was there before.
    """
    n = src.numel()
    _late_copy_kernel()[(-(-n // 1024),)](src, dst, n, int(delay_s * 1e9), BLOCK=1024)


@pytest.mark.gpu
def test_a_dependent_kernel_starts_under_its_primary_and_waits_for_its_writes():
    """Launched with launch_pdl after a slow primary, a kernel reading at once sees the memory
    as it was; one that waits first (tiles.wait_for_primary) sees the primary's writes."""
    import triton
    import triton.language as tl

    from shuttle.kernels.tiles import bind_tiles

    bind_tiles(globals(), "wait_for_primary")
    if not launch.dependent_launch(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs sm_90 and a Triton with it")

    @triton.jit
    def read(src_ptr, dst_ptr, n, WAIT: tl.constexpr, BLOCK: tl.constexpr):
        if WAIT:
            wait_for_primary()
        offs = tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)

    src = torch.arange(1, 257, dtype=torch.float32, device="cuda")
    for wait in (False, True):  # compiled first: a compile would outlast the primary
        read[(1,)](src, torch.empty_like(src), 256, WAIT=wait, BLOCK=256, launch_pdl=True)
    late_copy(src, torch.empty_like(src))
    for wait in (False, True):
        mid = torch.zeros_like(src)
        got = torch.empty_like(src)
        late_copy(src, mid)
        read[(1,)](mid, got, 256, WAIT=wait, BLOCK=256, launch_pdl=True)
        torch.cuda.synchronize()
        assert torch.equal(got, src) == wait
