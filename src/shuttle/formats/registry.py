"""The adapter format registry: a dict of :class:`AdapterFormat` plus a decorator.

A format here is a family of key spellings (how a tool names modules and tensors). Detection runs
in priority order over the key names alone; the first format whose rule matches names the file.
Adding a format is one new module with one decorated detection function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

__all__ = ["FORMATS", "AdapterFormat", "detect_format", "register_format"]

DetectFn = Callable[[Collection[str], "dict[str, Any] | None"], bool]


@dataclasses.dataclass(frozen=True)
class AdapterFormat:
    """One registered format.

    Attributes:
        name: the value of ``LoRA.format``.
        description: one line for ``shuttle inspect`` and the docs.
        detect: ``detect(keys, config) -> bool`` over the tensor names (and a PEFT config).
        priority: lower runs first.
        rename: maps a key of this format onto the common spellings of ``roles.role_suffixes()``
            before it is parsed (for formats with names of their own, such as XLabs).
        split_qkv_saves: the format's trainer saves fused ``qkv``/``linear1`` LoRAs as stacked
            per-split factors with one split's alpha (kohya's Flux save), each split scaled by
            ``alpha / r`` (``LowRank.split_qkv``).
        lokr_layout: how a full 3-D ``lokr_w2`` of a Conv1d is laid out (``"lycoris"``, or
            ``"peft"`` for PEFT's ``make_kron``).
    """

    name: str
    description: str
    detect: DetectFn
    priority: int
    rename: Callable[[str], str] | None = None
    split_qkv_saves: bool = False
    lokr_layout: str = "lycoris"


FORMATS: dict[str, AdapterFormat] = {}


def register_format(
    name: str, *, description: str, priority: int, rename: Callable[[str], str] | None = None,
    split_qkv_saves: bool = False, lokr_layout: str = "lycoris",
) -> Callable[[DetectFn], DetectFn]:
    """Register the decorated ``detect(keys, config)`` function as format ``name``, with the
    format's traits (:class:`AdapterFormat`), which the assembler reads.
    """

    def deco(detect: DetectFn) -> DetectFn:
        assert name not in FORMATS, f"format {name!r} registered twice"
        FORMATS[name] = AdapterFormat(name, description, detect, priority, rename,
                                      split_qkv_saves, lokr_layout)
        return detect

    return deco


def detect_format(keys: Collection[str], config: dict[str, Any] | None) -> AdapterFormat | None:
    """The first registered format (by priority) whose rule matches, or None."""
    for fmt in sorted(FORMATS.values(), key=lambda f: f.priority):
        if fmt.detect(keys, config):
            return fmt
    return None
