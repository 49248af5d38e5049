"""The counters a launch's programs share (``tiles.take_ticket`` and its partners).

A launch whose programs wait for each other needs three int32 counters at zero when it starts;
it leaves them at zero when it ends (its last program resets them). Launches on one stream run
one after another, so every eager launch on a stream shares that stream's counters: one
allocation per (device, stream), and no launch spent zeroing them. A launch captured in a CUDA
graph may be replayed on any stream, beside other graphs' replays and eager work, so it gets
counters of its own, taken from a block zeroed before the capture (zeroing them inside the
capture would add a memset to every replay).
"""

from __future__ import annotations

import threading

import torch

from shuttle.kernels.launch import current_stream_handle

__all__ = ["launch_semaphore"]

_COUNTERS = 3  # tickets taken, partials published, programs finished
_BLOCK = 1024  # counters' sets zeroed at once for captured launches (12 KiB)

_by_stream: dict[tuple[int, int], torch.Tensor] = {}  # (device index, stream handle) -> (3,)
_spare: dict[int, list[torch.Tensor]] = {}  # device index -> zeroed sets for captured launches
_low: set[int] = set()  # devices whose spare sets a capture drew below half: refilled eagerly
_lock = threading.Lock()


def launch_semaphore(device: torch.device, capturing: bool | None = None) -> torch.Tensor:
    """(3,) int32 zeros on ``device`` for one launch of a kernel whose programs wait for each
    other and that resets them when it ends.

    ``capturing``: whether a CUDA graph is being captured on the current stream, where the
    caller knows (None: asked here). Off CUDA (the interpreter runs programs in order) one set
    per device.
    """
    if device.type != "cuda":
        key = (-1, 0)
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if capturing is None:
            capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            return _for_capture(device, index)
        key = (index, current_stream_handle(index))
    found = _by_stream.get(key)
    if found is None:
        with _lock:
            found = _by_stream.setdefault(
                key, torch.zeros(_COUNTERS, dtype=torch.int32, device=device))
        if device.type == "cuda" and key[0] not in _spare:
            _low.add(key[0])
    if _low and key[0] in _low:
        _refill(device, key[0])
    return found


def _refill(device: torch.device, index: int) -> None:
    """Zero a block of sets for captured launches (called outside a capture: allocated and
    zeroed now, not in a graph).
    """
    block = torch.zeros(_BLOCK, _COUNTERS, dtype=torch.int32, device=device)
    with _lock:
        _spare.setdefault(index, []).extend(block.unbind(0))
        _low.discard(index)


def _for_capture(device: torch.device, index: int) -> torch.Tensor:
    """A set of its own for a launch being captured: a spare one, else one zeroed in the graph
    (a memset in each replay: correct, a little slower).
    """
    with _lock:
        spare = _spare.get(index)
        if spare is None or len(spare) <= _BLOCK // 2:
            _low.add(index)
        if spare:
            return spare.pop()
    return torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
