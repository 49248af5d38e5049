"""Per-request scaling of every active dynamic adapter: ``with shuttle.lora_scale(0.5): ...``.

The scale belongs to the context that set it (a :class:`contextvars.ContextVar`): another
thread, or another asyncio task, keeps its own (1 unless it sets one), so concurrent requests on
one model do not see each other's scales. Eager layers read it through :func:`request_scale`:
a 0-dim float32 tensor per device and value, never written, so a kernel queued under one scale
reads that scale whatever another thread sets later. The :data:`MAX_CACHED_SCALES` most
recently used of them are kept (a server passing a scale per request would otherwise keep one
per value it ever saw); one dropped goes back to PyTorch's caching allocator, which reuses its
memory only for work queued after the kernels already queued on its stream, so a queued read
keeps its value.

Code traced by ``torch.compile`` or captured into a CUDA graph cannot look a value up per call.
It reads one tensor per device that :func:`lora_scale` updates in place, so a compiled model or
a captured graph follows a new scale without recompiling or re-capturing. That tensor holds the
scale of the most recently opened scope still open, in any thread, task or generator (1 once
none is): under ``torch.compile`` or CUDA graphs the request scale is process-wide, and
:func:`~shuttle.scaled_stream` does not change that. Give concurrent requests of compiled models
their own strengths (or models) instead.

A CUDA graph replays without Python, so a layer captured in one cannot recompute its combined
scales (``alpha/r * strength * request``) per replay without kernels of its own in the graph.
It reads a vector of its own instead, and becomes a *follower* of its attachment's
:class:`~shuttle.apply.strength.Strengths` when captured (:func:`follow`): a strength change
there rewrites that attachment's followers' vectors, and a change of the shared scale here
rewrites every attachment's, in place, on the current stream, before the next replay.
Strengths, their generation and their followers belong to each attachment; only the request
scale is process-wide.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

from shuttle.apply.strength import Follower, Strengths, check_strength

__all__ = ["MAX_CACHED_SCALES", "follow", "lora_scale", "prepare_request_scale",
           "request_scale", "request_scale_value", "shared_request_scale",
           "shared_request_scale_value"]

# Eager per-value tensors kept (least recently used dropped first): requests cycling through
# more distinct scales than this recreate a tensor (one small fill) now and then.
MAX_CACHED_SCALES = 64

_scale: contextvars.ContextVar[float] = contextvars.ContextVar("shuttle_lora_scale", default=1.0)
_lock = threading.Lock()
# eager: never written; (device, value) -> tensor, most recently used last
_by_value: OrderedDict[tuple[torch.device, float], torch.Tensor] = OrderedDict()
_shared: dict[torch.device, torch.Tensor] = {}  # compiled and captured code: written in place
_shared_value = 1.0  # the scale of the most recently opened scope still open
_open: dict[object, float] = {}  # open lora_scale scopes, in the order opened -> scale
# attachments with layers captured into CUDA graphs: a shared-scale change rewrites their
# followers' vectors
_followed: weakref.WeakSet[Strengths] = weakref.WeakSet()


def request_scale(device: torch.device) -> torch.Tensor:
    """The request scale as a 0-dim float32 tensor on ``device``: this context's value in eager
    code, the process-wide shared tensor inside ``torch.compile`` or a CUDA graph capture.
    """
    if torch.compiler.is_compiling() or (device.type == "cuda"
                                         and torch.cuda.is_current_stream_capturing()):
        return shared_request_scale(device)
    key = (device, _scale.get())
    with _lock:
        t = _by_value.get(key)
        if t is None:
            t = _by_value[key] = torch.full((), key[1], dtype=torch.float32, device=device)
            if len(_by_value) > MAX_CACHED_SCALES:
                _by_value.popitem(last=False)
        else:
            _by_value.move_to_end(key)
    return t


def prepare_request_scale(device: torch.device) -> None:
    """Create ``device``'s shared tensor ahead of any compiled forward (created while tracing,
    it would change a dict dynamo guards, and cost a recompile on the next call).
    """
    if device not in _shared:
        _shared_tensor(device)


def _shared_tensor(device: torch.device) -> torch.Tensor:
    with _lock:
        return _shared.setdefault(device, torch.full((), _shared_value, dtype=torch.float32,
                                                     device=device))


def request_scale_value() -> float:
    """This context's request scale as a Python float (for the exact tier); inside
    ``torch.compile``, the process-wide value (a guarded constant: a change recompiles).
    """
    if torch.compiler.is_compiling():
        return _shared_value
    return _scale.get()


def shared_request_scale_value() -> float:
    """The process-wide request scale (what compiled code and captured graphs read) as a
    Python float: the scale of the most recently opened scope still open, 1 once none is.
    """
    return _shared_value


def shared_request_scale(device: torch.device) -> torch.Tensor:
    """The process-wide request scale tensor of ``device`` (what captured graphs read)."""
    t = _shared.get(device)
    return t if t is not None else _shared_tensor(device)


def follow(strengths: Strengths, layer: Follower) -> None:
    """Have ``layer``'s vector rewritten from now on whenever ``strengths`` (its attachment's)
    or the shared request scale changes (both weakly held).
    """
    strengths.follow(layer)
    with _lock:
        _followed.add(strengths)


def _refresh_followers() -> None:
    with _lock:
        owners = list(_followed)
    for strengths in owners:
        strengths.refresh_followers()


@contextlib.contextmanager
def lora_scale(scale: float) -> Iterator[None]:
    """Scale every active dynamic adapter by ``scale`` inside the block, for this thread or task
    only (compiled models and CUDA graphs: process-wide, see the module docs), without
    touching models.

    The scale belongs to the :mod:`contextvars` context that enters the block. A generator
    shares its caller's context, so a scope opened inside a generator (a streamed response)
    stays in force for its caller while the generator is paused at a ``yield``: wrap such a
    generator with :func:`~shuttle.scaled_stream` to keep the scale to the generator's own
    steps.

    Raises:
        InvalidStrengthError: ``scale`` is not a finite number.
    """
    scale = float(check_strength(scale, f"lora_scale({scale!r})"))
    token = _scale.set(scale)
    scope = object()
    _update_shared(lambda: _open.__setitem__(scope, scale))
    try:
        yield
    finally:
        try:
            _scale.reset(token)  # ValueError when closed in another context than it opened
        finally:
            _update_shared(lambda: _open.pop(scope))


def _update_shared(change: Callable[[], object]) -> None:
    """Open or close a scope (``change`` edits ``_open``), then write the scale of the most
    recently opened scope still open (1 when none is) into the shared tensors.

    Scopes of different threads, tasks or generators close in any order: restoring the value
    seen on entry would leave a closed scope's scale behind (A opens 0.5, B opens 2, A closes,
    B closes: 0.5 with no scope open).
    """
    global _shared_value
    with _lock:
        change()
        previous, _shared_value = _shared_value, next(reversed(_open.values()), 1.0)
        for t in _shared.values():
            t.fill_(_shared_value)
    if _shared_value != previous:
        _refresh_followers()
