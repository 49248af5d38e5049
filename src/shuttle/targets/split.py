"""Where rows of an adapter module's update go: :class:`Split` and the mapping value types."""

from __future__ import annotations

from typing import NamedTuple, Union

__all__ = ["MappingValue", "Rows", "Split"]

Rows = tuple[int, int]


class Split(NamedTuple):
    """Rows ``source_rows`` of an adapter module's update go to ``rows`` of module ``path``.

    A list of splits sends one adapter module to several model modules: a BFL Flux LoRA's fused
    ``img_attn.qkv`` onto diffusers' separate ``to_q``, ``to_k``, ``to_v``, for instance.
    ``None`` means all rows.
    """

    path: str
    source_rows: Rows | None = None
    rows: Rows | None = None


# A mapping sends an adapter module key to a module path, a path and the rows of its parameter,
# or a list of splits.
MappingValue = Union[str, tuple[str, Rows], list[Split]]  # noqa: UP007 - a runtime alias
