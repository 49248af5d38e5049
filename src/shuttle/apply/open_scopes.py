"""The merge blocks open on each model: ``apply_lora(mode="merge")`` scopes, nested.

Each open scope keeps what it restores on exit (the parameters' originals, the layers it widened).
Scopes on one model form a stack; :func:`close_scope` leaves it, and :func:`merged_parameters`
says what the open scopes hold merged (an unmerge, a save or a PEFT wrap asks before writing).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from shuttle.errors import ScopeOrderError
from shuttle.weights import WeightRepresentation

__all__ = ["OPEN_SCOPES", "MergeScope", "close_scope", "merged_parameters"]


@dataclasses.dataclass(eq=False)
class MergeScope:
    """What one open merge scope restores on exit (handed on when it exits out of order)."""

    backups: dict[str, torch.Tensor | WeightRepresentation]
    widened: list


# model -> its open merge scopes, oldest first
OPEN_SCOPES: weakref.WeakKeyDictionary[torch.nn.Module, list[MergeScope]] = \
    weakref.WeakKeyDictionary()


def merged_parameters(model: torch.nn.Module) -> list[str]:
    """Names (relative to ``model``) of the parameters that an open ``apply_lora(mode="merge")``
    block on ``model`` or one of its submodules holds merged right now.
    """
    out = []
    for prefix, module in model.named_modules():
        for scope in OPEN_SCOPES.get(module, ()):
            out.extend(f"{prefix}.{n}" if prefix else n for n in scope.backups)
    return out


def close_scope(model: torch.nn.Module, scope: MergeScope) -> None:
    """Leave the stack of open scopes; out of order, hand the originals to the next scope.

    Scopes nest: a later scope's backups hold this one's merge. Restoring here would undo the
    later scope's merge too, and its exit would then write this merge back for good. So the
    older copies (and widened layers) go to the next open scope, which restores them on its
    exit, and the exit is refused with nothing changed.

    Raises:
        ScopeOrderError: a later scope on ``model`` is still open.
    """
    stack = OPEN_SCOPES[model]
    i = stack.index(scope)
    del stack[i]
    if i == len(stack):
        return
    later = stack[i]
    later.backups.update(scope.backups)  # the older copy of a parameter both merged wins
    later.widened[:0] = scope.widened
    scope.backups.clear()
    scope.widened.clear()
    raise ScopeOrderError(
        f"apply_lora scope {i + 1} of {len(stack) + 1} on this model exited while a later one "
        "was still open; its merge stays until that scope exits, which restores the weights of "
        "both. Exit scopes in reverse order of entry (nest the with blocks)."
    )
