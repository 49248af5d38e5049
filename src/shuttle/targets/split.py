"""Where rows of an adapter module's update go: :class:`Split` and the mapping value types."""

from __future__ import annotations

from typing import NamedTuple, Union

__all__ = ["MappingValue", "Rows", "Split"]

Rows = tuple[int, int]


class Split(NamedTuple):
    """Rows ``source_rows`` of an adapter module's update go to ``rows`` of module ``path``.

    A list of splits sends one adapter module to several model modules: a BFL Flux LoRA's fused
    ``img_attn.qkv`` onto diffusers' separate ``to_q``, ``to_k``, ``to_v``, for instance.
    ``None`` means all rows. ``params`` renames the adapter's parameters where the model calls
    them otherwise, as ``((adapter_param, model_param), ...)``: BFL's RMSNorm ``scale`` is
    diffusers' ``norm_q.weight``, so ``Split(".../attn.norm_q", params=(("scale", "weight"),))``.
    """

    path: str
    source_rows: Rows | None = None
    rows: Rows | None = None
    params: tuple[tuple[str, str], ...] = ()


# A mapping sends an adapter module key to a module path, a path and the rows of its parameter,
# or a list of splits.
MappingValue = Union[str, tuple[str, Rows], list[Split]]  # noqa: UP007 - a runtime alias
