"""What merges into one model remember between calls: one :class:`MergeMemo` per model.

A server that merges the same adapters into the same model again and again (switching adapters
per request) would otherwise redo host work whose cost rivals the merge kernels' GPU time. The
memo keeps three things, each checked against what it was built from before it is used, so that
nothing it holds can change a result, only skip work:

- placements: where each adapter's keys land in the model's parameters (resolution and shape
  checks), per adapter object, valid while the parameters' names, shapes and kinds and the
  adapter's patch objects are the ones it was built for;
- finite verdicts: adapter tensors found free of NaN/inf, with ``max |t|`` (merges bound their
  updates by it), valid while the tensor is not modified in place (its version counter);
- recipes: the kernel launches of recent merges (:mod:`shuttle.apply.recipe`).

The memo belongs to the model: :func:`memo_of` finds it (weakly keyed, it dies with the model),
:func:`clear_memo` drops it; a model that :class:`~shuttle.cache.ModelCache` evicts is dropped,
and its memo with it. Entries hold adapters and their tensors weakly, so a memo never keeps an
adapter alive. Plans made without a model (a checkpoint's header, a file merge) get a fresh memo
of their own.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from shuttle.apply.recipe import MergeRecipe

__all__ = ["MergeMemo", "clear_memo", "memo_of"]


class MergeMemo:
    """One model's remembered merge work (see the module docs).

    Attributes:
        placements: adapter -> ``(parameter signature, patch ids, placement)``.
        recipes: the model's recent merge recipes, most recent first.
    """

    def __init__(self) -> None:
        self.placements: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # id(tensor) -> (weak ref, version, max |t|): read per adapter tensor on every merge,
        # where a WeakIdKeyDictionary's Python-level key comparisons cost more host time than
        # the check saves; an entry leaves with its tensor (the weak ref's callback)
        self._finite: dict[int, tuple[weakref.ref, int, float]] = {}
        self.recipes: list[MergeRecipe] = []

    def __len__(self) -> int:
        return len(self.placements) + len(self._finite) + len(self.recipes)

    def __repr__(self) -> str:
        return (f"MergeMemo(placements={len(self.placements)}, finite={len(self._finite)}, "
                f"recipes={len(self.recipes)})")

    def clear(self) -> None:
        """Forget everything (the next merge redoes its host work)."""
        self.placements.clear()
        self._finite.clear()
        self.recipes.clear()

    def known_abs_max(self, t: torch.Tensor) -> float | None:
        """``max |t|`` as the finite check measured it, if ``t`` was checked and not modified
        in place since; else None.
        """
        entry = self._finite.get(id(t))
        if entry is None or entry[0]() is not t or entry[1] != t._version:
            return None
        return entry[2]

    def known_finite(self, t: torch.Tensor) -> bool:
        """Whether ``t`` was found finite and not modified in place since."""
        return self.known_abs_max(t) is not None

    def mark_finite(self, t: torch.Tensor, abs_max: float) -> None:
        """Record that ``t`` is finite, with its largest magnitude."""
        key, table = id(t), self._finite
        table[key] = (weakref.ref(t, lambda _: table.pop(key, None)), t._version, abs_max)


_MEMOS: weakref.WeakKeyDictionary[Any, MergeMemo] = weakref.WeakKeyDictionary()


def memo_of(model: torch.nn.Module) -> MergeMemo:
    """``model``'s memo (created empty on first use; it dies with the model)."""
    memo = _MEMOS.get(model)
    if memo is None:
        memo = _MEMOS[model] = MergeMemo()
    return memo


def clear_memo(model: torch.nn.Module) -> None:
    """Drop what merges into ``model`` remembered (no effect on the model's weights)."""
    memo = _MEMOS.pop(model, None)
    if memo is not None:
        memo.clear()
