"""A meter that reports given numbers, and what the handle tests read of a handle's modules.

The CPU has no device memory statistics: these tests give each module's activations
themselves, and byte figures come from the storages' own layouts.
"""

from __future__ import annotations

import contextlib

import torch

from shuttle.integrations import diffusers as shuttle_diffusers
from shuttle.integrations.activations import Reading
from shuttle.offload import ModelOffloader, floor_bytes


class FakeMeter:
    """Reports ``peaks[name]`` bytes (a number, or a function of nothing) for each call of
    module ``name`` with ``margin`` bytes, and logs ``(name, sample)`` per call."""

    def __init__(self, peaks: dict | None = None, margin: int = 0):
        self.peaks = peaks or {}
        self.margin = margin
        self.calls: list[tuple[str, bool]] = []

    @contextlib.contextmanager
    def measure(self, name, device, sample):
        self.calls.append((name, sample))
        reading = Reading()
        yield reading
        peak = self.peaks.get(name, 0)
        reading.peak, reading.margin = peak() if callable(peak) else peak, self.margin


def offload(pipe, budget, meter):
    return shuttle_diffusers.offload(pipe, max_host_bytes=2**22, vram_budget=budget,
                                     device="cpu", prefetch=1, meter=meter)


def sizes(off: ModelOffloader) -> tuple[int, int]:
    """(floor, everything resident) device weight bytes."""
    s = off.storage
    return floor_bytes(s), s.rest.layout.nbytes + sum(
        u.layout.nbytes for us in s.groups.values() for u in us)


def active(handle) -> set[str]:
    return {n for n, o in handle.offloaders.items() if o.active}


def record(module: torch.nn.Module, what) -> list:
    """The values of ``what()`` at each call of ``module`` (a forward pre-hook)."""
    seen: list = []
    module.register_forward_pre_hook(lambda m, a: seen.append(what()))
    return seen
