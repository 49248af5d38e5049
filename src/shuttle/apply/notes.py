"""Report notes: where shuttle applies an adapter differently from a peer tool, on purpose.

A note is not a problem with the input (those raise, or are listed in ``unmatched`` or
``skipped``): the adapter is applied as docs/formats.md says, and the note names the tool that
applies it differently and by how much, so that a comparison with that tool is not taken for a
bug in either.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from shuttle.apply.plan import MergePlan
from shuttle.patches import DoRA, LowRank

__all__ = ["Note", "NoteKind", "plan_notes"]

NoteKind = Literal["kohya-flux-split-qkv", "peft-wrapped"]

SPLIT_QKV_TEXT = (
    "kohya Flux split-qkv save (downs stacked to rank n*r, block-diagonal up, alpha of one "
    "split): shuttle scales each split by alpha/r, as sd-scripts trained it; diffusers' loader "
    "divides alpha by the stacked rank n*r, so its update is 1/3 of shuttle's on the q, k, v "
    "of *_attn_qkv and 1/4 on the q, k, v, mlp of linear1"
)
PEFT_WRAPPED_TEXT = (
    "these layers are wrapped by PEFT (diffusers' load_lora_weights, or a PeftModel): the "
    "update went into each wrapped layer's base_layer; PEFT's own adapters on them still add "
    "theirs in the forward while active (unload them, e.g. pipe.unload_lora_weights() or "
    "merge_and_unload(), to keep only this one)"
)


@dataclasses.dataclass(frozen=True)
class Note:
    """One fact about how adapters were applied, for whoever compares with another tool.

    Attributes:
        kind: what it is about. ``"kohya-flux-split-qkv"``: modules of a kohya Flux split-qkv
            save, scaled per split (docs/formats.md, "Where the tools disagree").
            ``"peft-wrapped"``: modules that landed on layers PEFT wraps, whose own adapters
            add to the update while active.
        keys: the adapter module keys concerned (``source::`` prefixed when several adapters
            were applied, as in ``unmatched``).
        text: the same in one sentence.
    """

    kind: NoteKind
    keys: tuple[str, ...]
    text: str


def plan_notes(plan: MergePlan) -> list[Note]:
    """The notes of a plan: one per adapter and kind, in adapter order.

    Reads the ``up`` of each kohya ``*qkv`` / ``*linear1`` module whose zeros decide whether it
    is a split save (merging reads it for the same reason; a loaded plan's patches keep it).
    """
    split: dict[int, dict[str, None]] = {}
    wrapped: dict[int, dict[str, None]] = {}
    for name, contribs in plan.params.items():
        for c in contribs:
            p = c.patch.inner if isinstance(c.patch, DoRA) else c.patch
            if isinstance(p, LowRank) and p.split_qkv and p.effective_scale != p.scale:
                split.setdefault(c.adapter, {})[c.module_key] = None
            if ".base_layer." in name:
                wrapped.setdefault(c.adapter, {})[c.module_key] = None
    several = len(plan.adapters) > 1

    def keys(i: int, found: dict[str, None]) -> tuple[str, ...]:
        return tuple(f"{plan.adapters[i][0].source}::{k}" if several else k for k in found)

    return ([Note("kohya-flux-split-qkv", keys(i, found), SPLIT_QKV_TEXT)
             for i, found in sorted(split.items())]
            + [Note("peft-wrapped", keys(i, found), PEFT_WRAPPED_TEXT)
               for i, found in sorted(wrapped.items())])
