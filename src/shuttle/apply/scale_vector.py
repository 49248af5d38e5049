"""The per-rank-column scale of a dynamic Linear's concatenated factors, and who reads it.

``s = base_scale * strength[col_adapter] * request`` ((R,) float32: alpha/r of each column's
adapter, that adapter's strength in its attachment, the request scale). Three readers:

    eager      a vector cached per (strengths' generation, request scale value), recomputed
               when either changes;
    compiled   the product over the shared tensors, traced once (no Python value guarded);
    CUDA graph the layer's own vector, captured by address: from capture on, this object
               follows its attachment's strengths and the shared scale (``apply.scale.follow``),
               which rewrite it in place on every change.
"""

from __future__ import annotations

import torch

from shuttle.apply.scale import (
    follow,
    request_scale,
    request_scale_value,
    shared_request_scale,
    shared_request_scale_value,
)
from shuttle.apply.strength import Strengths

__all__ = ["ScaleVector", "capture_state"]


def capture_state(device: torch.device) -> bool | None:
    """Whether a CUDA graph is being captured on ``device``'s current stream (False off CUDA);
    None while torch.compile traces (nothing is asked of CUDA then).
    """
    if torch.compiler.is_compiling():
        return None
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class ScaleVector:
    """The scale vector of one layer's factor slots (owned by its ``LoRAHook``).

    Args:
        strengths: the attachment's strengths.

    Attributes:
        base_scale: (R,) float32 alpha/r per rank column (0 in padding), set by the hook.
        col_adapter: (R,) long, the adapter of each rank column, set by the hook.
    """

    def __init__(self, strengths: Strengths):
        self.strengths = strengths
        self.base_scale: torch.Tensor | None = None
        self.col_adapter: torch.Tensor | None = None
        self._graph_scale: torch.Tensor | None = None  # what a captured CUDA graph reads
        self._graph_key: tuple[int, float] | None = None
        self._cached: tuple[tuple[int, float], torch.Tensor] | None = None  # eager: (key, s)
        self._cache_key: tuple[int, float] | None = None

    def stale(self) -> None:
        """Forget the eager vector (the columns' scales or adapters changed)."""
        self._cache_key = None

    def moved(self) -> None:
        """The columns moved to another device: forget the vectors no captured graph reads."""
        self._cache_key = None
        if not self.strengths.following(self):
            self._graph_scale = None

    def _graph_key_now(self) -> tuple[int, float]:
        """What a captured vector is computed from: its strengths' generation, the shared scale."""
        return self.strengths.generation, shared_request_scale_value()

    def _product(self, device: torch.device, request: torch.Tensor) -> torch.Tensor:
        return self.base_scale * self.strengths.tensor(device)[self.col_adapter] * request

    def __call__(self, device: torch.device, capturing: bool | None = None) -> torch.Tensor:
        """(R,) float32: alpha/r * strength * request per rank column, on ``device``.

        ``capturing``: whether a CUDA graph is being captured on ``device``'s stream, where the
        caller asked already (it is then not compiling); None: asked here.
        """
        if capturing is None:
            capturing = capture_state(device)
            if capturing is None:  # compiling: traced once, reads the shared tensors
                return self._product(device, request_scale(device))
        if capturing:
            # Replayed without Python: the graph reads this layer's own vector, which every
            # later change of its attachment's strengths or of the shared scale rewrites in
            # place (it follows them, see shuttle.apply.scale). One computed since the last
            # change is required; otherwise the product is computed inside the graph (three
            # small kernels per replay).
            g = self._graph_scale
            if g is None or g.device != device or self._graph_key != self._graph_key_now():
                return self._product(device, request_scale(device))
            follow(self.strengths, self)
            return g
        # this attachment's strengths, and this context's scale
        key = (self.strengths.generation, request_scale_value())
        # (key, vector) read and written as one object: another thread may replace it at any
        # moment, with its own scale's vector.
        cached = self._cached
        if self._cache_key != key or cached is None or cached[0] != key:
            cached = (key, self._product(device, request_scale(device)))
            self._cached, self._cache_key = cached, key
            if not self.strengths.following(self):  # no captured graph reads the old one
                self._graph_scale = self._product(device, shared_request_scale(device))
                self._graph_key = self._graph_key_now()
        return cached[1]

    def refresh_graph_scale(self) -> None:
        """Rewrite the captured vector in place from the current strengths and shared scale."""
        g = self._graph_scale
        if g is not None:
            g.copy_(self._product(g.device, shared_request_scale(g.device)))
            self._graph_key = self._graph_key_now()
