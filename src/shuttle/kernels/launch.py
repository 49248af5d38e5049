"""What the kernels' host sides share: whether Triton runs, grid arithmetic, scale constants on
the device, seeds, launches from compiled binaries (bound once for a layer's fixed launches),
and the weight and bias a prepared launch was built for.

Host time matters here: a whole-model merge launches once per group of weights and a dynamic
forward once or twice per layer, and every microsecond spent per launch in Python is a
microsecond the GPU may wait (docs/benchmarks.md, merge).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BoundLaunch", "CompiledLaunch", "LayerOperands", "cdiv", "current_stream_handle",
           "dependent_launch", "device_capability", "device_floats", "interpreting",
           "next_power_of_2", "on_device_of", "seed32", "sm_count", "triton_available"]


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (it is an optional dependency: ``shuttle[triton]``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def device_capability(device: torch.device | int) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, asked of the driver once per device (the
    kernels' wrappers check it on every call: every dynamic forward, every float8 upcast).
    """
    return torch.cuda.get_device_capability(device)


@functools.cache
def dependent_launch(index: int) -> bool:
    """Whether Triton kernels on CUDA device ``index`` can be launched as programmatic
    dependents (``launch_pdl=True``: the kernel starts while the one before it in the stream
    still runs, and waits where it reads that kernel's output; ``shuttle.kernels.tiles.
    wait_for_primary``): an sm_90 or later device, compiled kernels (not the interpreter, which
    Triton fixes per process as this does) and a Triton with grid dependency control.
    """
    if interpreting() or not triton_available():
        return False
    from shuttle.kernels.tiles import dependent_launch_available

    return dependent_launch_available() and device_capability(index) >= (9, 0)


@functools.cache
def sm_count(index: int | None) -> int:
    """The streaming multiprocessors of CUDA device ``index``, asked once per device (grids
    are sized by it on every launch of the persistent and split-K kernels).
    """
    return torch.cuda.get_device_properties(index).multi_processor_count


def current_stream_handle(index: int) -> int:
    """The raw handle (``cudaStream_t`` as an int) of CUDA device ``index``'s current stream.

    ``torch.cuda.current_stream(i).cuda_stream`` builds a Python ``Stream`` object on every
    call, costing microseconds of host time per launch of a kernel that takes the stream as
    an argument; torch's own raw query (the one Triton's launcher and Inductor read) returns
    the int directly. The public way where a torch build lacks that query.
    """
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grid sizes on the host (``triton.cdiv`` is a Triton function, slow
    to call from Python: several calls per launch add up when merging hundreds of weights).
    """
    return -(-a // b)


def seed32(seed: int) -> int:
    """A 64-bit seed folded to the 32 bits of the kernels' ``hash_uniform``."""
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), on the host (as :func:`cdiv`)."""
    return 1 << max(n - 1, 0).bit_length()


def device_floats(values: list[float], device: torch.device) -> torch.Tensor:
    """A float32 tensor of ``values`` on ``device``, without a host sync; do not modify it.

    On CUDA the tensors are cached by value (the scales of one merge repeat from weight to
    weight): a new one costs a launch or a copy, several microseconds of host time per weight.
    Cached tensors are never freed (a freed one could be reused while a kernel queued on
    another stream still reads it); past :data:`_MAX_CACHED_FLOATS` values new ones are not
    cached. A new tensor goes through a pinned staging buffer, copied asynchronously:
    ``torch.tensor(values, device="cuda")`` copies from pageable memory, which waits for the
    stream to drain.
    """
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.float32, device=device)
    key = (tuple(values), device)
    cached = _FLOATS.get(key)
    if cached is not None:
        return cached
    host = torch.tensor(values, dtype=torch.float32).pin_memory()
    out = host.to(device, non_blocking=True)
    # Memory allocated while a CUDA graph is captured belongs to the graph: not cached.
    if len(_FLOATS) < _MAX_CACHED_FLOATS and not torch.cuda.is_current_stream_capturing():
        _FLOATS[key] = out
    return out


_FLOATS: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}
_MAX_CACHED_FLOATS = 4096


def on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context in which a launch for ``t`` goes to ``t``'s GPU: Triton launches on the current
    device's stream. Nothing to enter (no device switch, a few microseconds saved) when ``t`` is
    on the current device or not on a GPU.
    """
    if not t.is_cuda:
        return _NOTHING
    index = t.get_device()
    return _NOTHING if index == torch.cuda.current_device() else torch.cuda.device(index)


_NOTHING = contextlib.nullcontext()  # stateless: one instance serves every call


class LayerOperands:
    """A layer's weight and bias as a prepared launch was built for them: held weakly (a
    replaced parameter is not kept alive here), with their layout then.
    """

    __slots__ = ("_bias", "_layout", "_weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._weight = weakref.ref(weight)
        self._bias = weakref.ref(bias) if bias is not None else None
        self._layout = self._layout_of(weight, bias)

    @staticmethod
    def _layout_of(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        # What a parameter can change without becoming another object (``param.data = ...``,
        # as offloading does): its storage, dtype, shape and strides.
        return (weight.data_ptr(), weight.dtype, weight.shape, weight.stride(),
                bias.data_ptr() if bias is not None else 0)

    def fits(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether these are the weight and bias held, still laid out as they were."""
        return (weight is self._weight()
                and bias is (self._bias() if self._bias is not None else None)
                and self._layout == self._layout_of(weight, bias))

    def get(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The weight (None once freed) and the bias."""
        return self._weight(), self._bias() if self._bias is not None else None


class CompiledLaunch:
    """A Triton kernel launched from its compiled binary, without Triton's per-call dispatch.

    ``kernel[grid](*args)`` binds and specializes every argument on each call, then looks the
    binary up: about half the host time of one launch of the fused LoRA kernel. For a kernel
    compiled with ``do_not_specialize`` on every runtime argument (no value or alignment
    compiled in), the binary depends only on the arguments' types (tensor dtypes; 32- or 64-bit
    ints), the constexprs and the device: this keeps it under that key after the first launch
    and launches it directly. The binary's launcher for a grid (``binary[grid]``, which looks
    the device and its stream up through Triton's driver on every call) is kept per grid too,
    and given the current stream's raw handle.

    The first launch of each key, the interpreter, and a Triton whose compiled-kernel interface
    this does not know (a failure while fetching the binary or making its launcher) take
    Triton's own path.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        # key -> (binary, the constexprs in the kernel's order, grid -> launcher)
        self._binaries: dict[tuple, tuple[Any, tuple, dict[tuple, Any]]] = {}
        self.direct = True  # False once fetching a binary failed: Triton's own path only

    def __call__(self, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        """``kernel[grid](*args, **constexprs)``.

        ``grid`` a tuple of ints; ``args`` the runtime arguments, in the kernel's order and
        before its constexprs; ``constexprs`` every compile-time argument, with ``num_warps``
        and ``num_stages``.
        """
        if not self.direct or interpreting():
            self.kernel[grid](*args, **constexprs)
            return
        device = torch.cuda.current_device()
        key = _key(device, args, constexprs)
        found = self._binaries.get(key)
        if found is not None:
            binary, tail, launchers = found
            run = launchers.get(grid)
            if run is not None:
                run(*args, *tail, stream=current_stream_handle(device))
                return
            run = binary[grid + (1,) * (3 - len(grid))]
            try:
                run(*args, *tail, stream=current_stream_handle(device))
            except TypeError as e:
                if "stream" not in str(e):  # the arguments' own fault: Triton's message
                    raise
                self.direct = False  # a launcher that takes no stream: Triton's path from now
                self.kernel[grid](*args, **constexprs)
                return
            if len(launchers) < _MAX_GRIDS:  # grids that vary call to call: not all kept
                launchers[grid] = run
            return
        self.kernel[grid](*args, **constexprs)
        try:
            binary = self.kernel.warmup(*args, grid=grid, **constexprs)  # cached: no compile
            names = [p.name for p in self.kernel.params]
            tail = tuple(constexprs[n] for n in names[len(args):])
            binary[grid + (1,) * (3 - len(grid))]  # loads the module here; fails if it cannot
        except Exception:  # noqa: BLE001 - another Triton's interface: keep Triton's own path
            self.direct = False
            return
        self._binaries[key] = (binary, tail, {})

    def bind(self, grid: tuple[int, ...], **constexprs: Any) -> BoundLaunch:
        """This kernel on ``grid`` with ``constexprs`` (with ``num_warps``, ``num_stages``), for
        a caller whose arguments keep their types call to call (see :class:`BoundLaunch`).
        """
        return BoundLaunch(self, grid, constexprs)

    def launcher(self, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any]
                 ) -> tuple[Callable[..., None], tuple, int] | None:
        """How to launch ``kernel[grid](*args, **constexprs)`` directly on the current device,
        for arguments of ``args``' types: ``(run, tail, device)``, called as
        ``run(*args, *tail, stream=current_stream_handle(device))``, once a direct launch of
        that binary on that grid was made; else None (the first launches, the interpreter,
        Triton's path).
        """
        if not self.direct or interpreting():
            return None
        device = torch.cuda.current_device()
        found = self._binaries.get(_key(device, args, constexprs))
        run = found[2].get(grid) if found is not None else None
        return None if run is None else (run, found[1], device)


class BoundLaunch:
    """A :class:`CompiledLaunch` kernel on one grid with one set of constexprs.

    A layer's decode kernels launch with the same grid, constexprs, argument dtypes and int
    widths on every call; only addresses and a few small ints change. Bound once, a call
    launches the binary's launcher directly: no key built from the arguments and no lookups,
    the part of :class:`CompiledLaunch`'s host time that depends on the argument count. The
    caller keeps to what the binary was compiled for: the tensors' dtypes, every int within
    int32 or every one beyond (as at the first calls), and the device (entered, as for any
    Triton launch). Until the binary and its launcher exist (the first two calls), under the
    interpreter and on Triton's own path, a call goes through the :class:`CompiledLaunch`.
    """

    __slots__ = ("_compiled", "_constexprs", "_device", "_grid", "_run", "_tail")

    def __init__(self, compiled: CompiledLaunch, grid: tuple[int, ...],
                 constexprs: dict[str, Any]) -> None:
        self._compiled, self._grid, self._constexprs = compiled, grid, constexprs
        # the binary's launcher, the constexprs it takes after the arguments, its device
        self._run: Callable[..., None] | None = None
        self._tail: tuple = ()
        self._device = 0

    def __call__(self, *args: Any) -> None:
        """``kernel[grid](*args, **constexprs)``; ``args`` the runtime arguments in order."""
        run = self._run
        if run is not None:
            run(*args, *self._tail, stream=current_stream_handle(self._device))
            return
        self._compiled(self._grid, *args, **self._constexprs)
        found = self._compiled.launcher(self._grid, args, self._constexprs)
        if found is not None:
            self._run, self._tail, self._device = found


def _key(device: int, args: tuple, constexprs: dict[str, Any]) -> tuple:
    """A binary's key: the device, the constexprs, and Triton's signature of each
    unspecialized argument (a tensor's dtype, whether an int fits in 32 bits, else its type).
    """
    return (device, *constexprs.items(),
            *[a.dtype if isinstance(a, torch.Tensor)
              else -0x80000000 <= a <= 0x7FFFFFFF if type(a) is int else type(a)
              for a in args])


_MAX_GRIDS = 64  # launchers kept per binary (a layer's grid depends on its shape alone)
