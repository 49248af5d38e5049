"""What a module's calls allocate on the device beyond its weights, measured so that the
planner can count it.

A handle's ``vram_budget`` is a ceiling on the measured peak (``torch.cuda.max_memory_allocated``
over a whole pipeline call), which holds weights *and* activations. So each module's weights are
planned within the budget less its *activation reserve*: the largest activation peak seen on
its calls plus a margin (:class:`Reading`). Before a module's first call nothing is known: the
handle runs that call at the floor (every block streams, no resident block:
:class:`~shuttle.offload.RingOnlyResidency`) with every other module taken off the device, then
plans again through ``plan_for`` with the measurement in
(``StreamConfig(activation_bytes=...)``), and again whenever a later call outgrows the reserve.

**A call's activation peak** is the largest ``torch.cuda.memory_allocated(device)`` during the
call less what was allocated when it started: the module's activations and workspaces. What
was there before (the weights shuttle holds on the device, every active module's slots, and
whatever the caller keeps on the device: the pipeline's latents and embeddings, or a model of
its own) is not the call's. The budget bounds shuttle's weights plus its modules' activations;
memory the caller holds beside them is the caller's (a pipeline's latents and embeddings are a
few MB at 1024x1024, within the margin below).

**Measuring it without resetting the peak statistics** (``reset_peak_memory_stats`` would
corrupt the caller's own measurement of the same peak), :class:`DeviceMeter` does:

1. On every call, reads ``max_memory_allocated`` before and after. If it rose, the call set a
   new process peak and that peak is the call's: the reading is exact.
2. On a module's measuring calls (its first, and the first after its mode changes), also samples
   ``memory_allocated`` before and after the forward of every module that runs (global forward
   hooks, removed when the call ends). When the call stays below an earlier process peak, the
   largest sample is the reading: a lower bound, since allocations made and freed inside one
   module's forward between two samples are missed.

**The margin** added to each reading, ``max(64 MiB, 10%)``, covers what sampling misses: the
transients inside one forward between two hooks (rotary embeddings computed in float32 over
the query and key, the attention kernel's output and statistics before the output projection
reads them, a cuBLAS workspace created mid-module), which for a DiT block at 1024x1024 are a
few hundred MB against several GB of activations. It also keeps the plan from changing for
small growth (a KV cache that grows per token re-plans once per margin, not per token). An
attention that materializes its score matrix (the math kernel, L x L per head) can exceed it:
such a call usually sets a new process peak, which is then read exactly.

**Before a first call that may not fit.** Measuring a call means running it, and a call whose
activations do not fit beside the module's floor (a VAE decoding 1024x1024 pixels untiled
under a 1.5 GiB budget) would go over the budget once before its shrinker is switched on. So a
module with a :class:`CallShrinker` is asked first to ``predict`` its first call: diffusers'
autoencoders run the call on a twin of themselves built on ``meta`` (no data, no device), and
:func:`meta_peak` counts the bytes its tensors hold at once; when that prediction plus the
margin does not fit, the call runs shrunk from the start. The count is of tensor bytes only
(no allocator rounding, no cuDNN workspaces), with attention counted as a fused kernel
allocates it (its output): a lower estimate than the device's (Flux's VAE decoding 1024x1024
in bf16 on an H100: 1.64x the predicted bytes, its convolutions' workspaces and the allocator's
rounding), so on CUDA a prediction counts :data:`PREDICTED_SCALE` times its bytes plus the
margin; the measurement of the call itself corrects the reserve afterwards.

On devices without CUDA memory statistics (the CPU test path) a reading is 0 bytes with no
margin: nothing is reserved. Tests pass their own meter (any object with ``measure``) to feed
the planner numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ActivationMeter", "CallShrinker", "DeviceMeter", "Reading", "margin", "meta_peak",
           "predicted_reserve"]

MARGIN_MIN = 64 * 2**20  # bytes
MARGIN_SHARE = 0.10
PREDICTED_SCALE = 2  # a prediction on meta against the device's peak: see the module docs


def margin(peak: int) -> int:
    """The bytes added to an activation peak for what its measurement may miss (module docs)."""
    return max(MARGIN_MIN, int(MARGIN_SHARE * peak))


@dataclass
class Reading:
    """What one call allocated on the device beyond the weights shuttle holds there.

    Attributes:
        peak: the call's activation peak in bytes (exact, or the largest sample).
        margin: bytes added for what the measurement may miss; the reserve is
            ``peak + margin``.
    """

    peak: int = 0
    margin: int = 0

    @property
    def reserve(self) -> int:
        """The bytes the planner keeps for this module's activations."""
        return self.peak + self.margin


@runtime_checkable
class ActivationMeter(Protocol):
    """Measures one call of a module.

    ``measure(name, device, sample)`` is a context manager around the call that yields a
    :class:`Reading`, filled in when the block ends; ``sample`` asks for the finer (slower)
    measurement of a module whose activations are not known yet.
    """

    def measure(self, name: str, device: torch.device,
                sample: bool) -> contextlib.AbstractContextManager[Reading]: ...


@runtime_checkable
class CallShrinker(Protocol):
    """Makes a module's calls allocate less device memory, at some cost (a VAE's tiled and
    sliced decoding): ``enable()`` when its activations do not fit the budget beside its
    weights, ``restore()`` the module's own settings when the handle is removed.
    ``predict(method, args, kwargs)`` gives the activation bytes the call
    ``module.method(*args, **kwargs)`` would allocate as the module is set now, without running
    it on the device (None: it cannot tell), so that a first call that would not fit is shrunk
    before it runs.
    """

    def enable(self) -> None: ...

    def restore(self) -> None: ...

    def predict(self, method: str, args: tuple[Any, ...],
                kwargs: Mapping[str, Any]) -> int | None: ...


class DeviceMeter:
    """The default meter: the CUDA caching allocator's statistics (see the module docs)."""

    @contextlib.contextmanager
    def measure(self, name: str, device: torch.device, sample: bool) -> Iterator[Reading]:
        """Measure the call run inside the block (see :class:`ActivationMeter`)."""
        reading = Reading()
        if device.type != "cuda":
            yield reading
            return
        start = _allocated(device, "current")  # weights held, the caller's tensors: not the call's
        before = _allocated(device, "peak")
        hooks = []
        if sample:
            def take(*_: object) -> None:
                reading.peak = max(reading.peak, _allocated(device, "current") - start)

            hooks = [torch.nn.modules.module.register_module_forward_pre_hook(take),
                     torch.nn.modules.module.register_module_forward_hook(take)]
        try:
            yield reading
        finally:
            for h in hooks:
                h.remove()
        after = _allocated(device, "peak")
        if after > before:  # this call set the process peak: its top is the call's own
            reading.peak = after - start
        reading.peak = max(reading.peak, 0)
        reading.margin = margin(reading.peak)


def predicted_reserve(predicted: int, device: torch.device) -> int:
    """The device bytes a call whose activations are predicted at ``predicted`` bytes is
    counted at: :data:`PREDICTED_SCALE` times plus the margin on CUDA, the bytes themselves
    elsewhere (where nothing is measured either).
    """
    if device.type != "cuda":
        return predicted
    return PREDICTED_SCALE * predicted + margin(predicted)


def meta_peak(fn: Callable[[], object]) -> int:
    """The most bytes that tensors created inside ``fn()`` hold at once.

    Meant for ``fn`` computing on ``meta`` tensors (shapes and dtypes only, nothing allocated):
    each operator's new outputs are counted until their storages are freed; views, in-place
    results and the tensors ``fn`` is given are not. ``F.scaled_dot_product_attention`` counts
    its output only, as the fused kernels allocate it (the math fallback's (L, S) scores per head
    are what they avoid).
    """
    with _FusedAttention(), _LiveBytes() as live:
        fn()
    return live.peak


class _LiveBytes(TorchDispatchMode):
    """Sums the bytes of the storages operators create while they are alive; keeps the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage id -> (ref, bytes)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        rets = func._schema.returns
        outs = out if isinstance(out, (tuple, list)) else (out,)
        # one return per output, or one list return (Tensor[]) for all of them
        fresh = [r.alias_info is None for r in rets] if len(rets) == len(outs) else (
            [bool(rets) and rets[0].alias_info is None] * len(outs))
        for t, new in zip(outs, fresh, strict=True):
            if isinstance(t, torch.Tensor) and new:  # a storage of its own, not a view
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                self.live[ref.cdata] = (ref, storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


class _FusedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as a fused kernel allocates: its (..., L, Ev) output."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q = args[0] if args else kwargs["query"]
            v = args[2] if len(args) > 2 else kwargs["value"]
            return q.new_empty((*q.shape[:-1], v.shape[-1]))
        return func(*args, **kwargs)


def _allocated(device: torch.device, which: str) -> int:
    # The nested form skips the flattening and sorting of memory_stats(): this runs in hooks.
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return stats.get("allocated_bytes", {}).get("all", {}).get(which, 0)
