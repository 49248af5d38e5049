"""The report of :func:`~shuttle.apply.extract.extract_lora`: one row per parameter, and totals."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

__all__ = ["ExtractReport", "ExtractRow"]


@dataclasses.dataclass
class ExtractRow:
    """What became of one parameter of the tuned checkpoint.

    Attributes:
        name: the parameter name.
        kind: ``"lora"``, ``"diff"``, ``"set"`` or ``"identical"``.
        shape: the parameter's shape.
        rank: the rank written (``lora`` only).
        bytes: bytes of the tensors written for it (0 when identical).
        dense_bytes: bytes of the tuned tensor in its own dtype.
        energy: fraction of ``||tuned - base||_F^2`` the payload captures (1.0 when exact).
        error: ``||delta - written|| / ||delta||`` after rounding to the stored dtype (0.0 when
            exact); for ``set`` relative to the tuned value.
        delta_norm: ``||tuned - base||_F`` in float32 (``||tuned||`` for ``set``).
        note: why this kind was chosen, when it was not the first choice.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    rank: int | None = None
    bytes: int = 0
    dense_bytes: int = 0
    energy: float = 1.0
    error: float = 0.0
    delta_norm: float = 0.0
    note: str = ""


@dataclasses.dataclass
class ExtractReport:
    """The outcome of :func:`extract_lora`.

    Attributes:
        rows: one :class:`ExtractRow` per parameter of the tuned checkpoint (float tensors).
        base_only: parameters only in the base: an adapter cannot remove them.
        skipped: parameter -> why no payload was written (changed integer tensors).
        path: the written file, or None when ``out`` was None.
        tensors: the adapter's tensors when ``out`` was None (else None).
        metadata: the ``__metadata__`` written.
    """

    rows: list[ExtractRow]
    base_only: list[str]
    skipped: dict[str, str]
    path: Path | None
    tensors: dict[str, torch.Tensor] | None
    metadata: dict[str, str]

    def _changed(self) -> list[ExtractRow]:
        return [r for r in self.rows if r.kind in ("lora", "diff")]

    @property
    def bytes(self) -> int:
        """Bytes of every tensor written."""
        return sum(r.bytes for r in self.rows)

    @property
    def dense_bytes(self) -> int:
        """Bytes the written parameters take in the tuned checkpoint's dtypes."""
        return sum(r.dense_bytes for r in self.rows if r.kind != "identical")

    @property
    def energy(self) -> float:
        """Fraction of the summed ``||delta||^2`` of all changed parameters that is captured."""
        total = sum(r.delta_norm**2 for r in self._changed())
        lost = sum((r.error * r.delta_norm) ** 2 for r in self._changed())
        return 1.0 - lost / total if total else 1.0

    @property
    def error(self) -> float:
        """``sqrt(sum ||residual||^2 / sum ||delta||^2)`` over all changed parameters."""
        return math.sqrt(max(0.0, 1.0 - self.energy))

    def counts(self) -> dict[str, int]:
        """How many parameters of each kind."""
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.kind] = out.get(r.kind, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary: totals, then the rows (tensors left out)."""
        return {
            "path": str(self.path) if self.path else None, "metadata": self.metadata,
            "counts": self.counts(), "bytes": self.bytes, "dense_bytes": self.dense_bytes,
            "energy": self.energy, "error": self.error, "base_only": self.base_only,
            "skipped": self.skipped, "rows": [dataclasses.asdict(r) for r in self.rows],
        }
