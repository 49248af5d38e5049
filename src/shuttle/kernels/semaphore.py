"""The counters and workspace of a launch whose programs wait for each other
(``tiles.take_ticket`` and its partners).

Such a launch needs three int32 counters at zero when it starts and leaves them at zero when it
ends (its last program resets them), and a float32 workspace for the partials its first
programs publish. Launches on one stream run one after another, so the eager launches on a
stream share that stream's counters and workspace: one allocation per (device, stream), no
launch spent zeroing counters or allocating. A launch captured in a CUDA graph may be replayed
on any stream, beside other graphs' replays and eager work, so it gets its own: counters from a
block zeroed before the capture (zeroing them inside the capture would add a memset to every
replay) and a workspace from the graph's memory.
"""

from __future__ import annotations

import threading

import torch

from shuttle.kernels.launch import current_stream_handle

__all__ = ["launch_scratch"]

_COUNTERS = 3  # tickets taken, partials published, programs finished
_BLOCK = 1024  # counters' sets zeroed at once for captured launches (12 KiB)

# (device index, stream handle) -> (counters (3,), workspace); off CUDA one entry, (-1, 0)
_by_stream: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
_spare: dict[int, list[torch.Tensor]] = {}  # device index -> zeroed sets for captured launches
_low: set[int] = set()  # devices whose spare sets ran below half: refilled by an eager launch
_lock = threading.Lock()


def launch_scratch(device: torch.device, floats: int, capturing: bool | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counters, workspace)`` for one launch on ``device``: (3,) int32 zeros the launch
    resets when it ends, and at least ``floats`` float32 elements it may overwrite.

    ``capturing``: whether a CUDA graph is being captured on the current stream, where the
    caller asked already (None: asked here). Off CUDA (the interpreter runs programs in order,
    one launch at a time) one set.
    """
    if device.type != "cuda":
        key = (-1, 0)
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if capturing is None:
            capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            return _for_capture(device, index), torch.empty(floats, dtype=torch.float32,
                                                            device=device)
        key = (index, current_stream_handle(index))
        if index in _low:
            _refill(device, index)
    found = _by_stream.get(key)
    if found is None or found[1].numel() < floats:
        with _lock:
            counters = found[0] if found is not None else torch.zeros(
                _COUNTERS, dtype=torch.int32, device=device)
            # a larger workspace replaces the old one, which earlier launches on this stream
            # still read: the caching allocator frees its memory in this stream's order
            found = _by_stream[key] = (counters, torch.empty(max(floats, 4096),
                                                             dtype=torch.float32, device=device))
            if device.type == "cuda" and key[0] not in _spare:
                _low.add(key[0])
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
