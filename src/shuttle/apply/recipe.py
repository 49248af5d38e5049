"""Repeat a merge without redoing its host work.

A server that merges the same adapter into the same model again and again (per request, through
``apply_lora(mode="merge")``, or switching between a few adapters) repeats the same fused kernel
launches each time. Preparing them costs host time per weight (choosing the kernel path, grouping
the weights, building the launch arguments), and on a slow host that time, not the GPU's, set the
merge's speed (docs/benchmarks.md, merge). A :class:`MergeRecipe` keeps the launches of one merge
of a model, with everything they were built from, and :func:`find_recipe` hands it back for the
next merge whose plan is the same: the same adapter objects at the same strengths, the same patch
objects on the same rows, the same parameter objects with the same storage layout (address,
device, shape, strides, dtype), the adapter tensors unmodified since. Anything else is a miss,
and the merge is prepared afresh.

Recipes are kept in the model's :class:`~shuttle.apply.memo.MergeMemo` (they die with the model
and go with :func:`~shuttle.apply.memo.clear_memo`), at most :data:`MAX_RECIPES` each, and are
dropped as soon as one of their adapters is garbage collected. They hold only what the adapter
and the model hold already: recipes are made only for merges whose kernel jobs are whole
parameters (no row-range or reshaped views, which would keep a replaced weight's old storage
alive) and use the adapter's factors as they are (no concatenated or padded copies).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from shuttle.apply.memo import MergeMemo
from shuttle.apply.plan import MergePlan
from shuttle.kernels.merge_lowrank import MergeLaunch

__all__ = ["MAX_RECIPES", "MergeRecipe", "find_recipe", "remember_recipe"]

MAX_RECIPES = 4  # per model: a server alternating between a few adapters hits every time


class MergeRecipe:
    """The fused launches of one merge, and what must hold for them to be launched again.

    Attributes:
        launches: the recorded kernel launches (weights, factors, scales, flags).
        fused: names of the parameters those launches merge.
        flags: the overflow flags the launches set, per device (zeroed before a replay).
    """

    def __init__(self, plan: MergePlan, params: Mapping[str, torch.Tensor], fused: list[str],
                 launches: list[MergeLaunch], flags: dict[torch.device, torch.Tensor]):
        self.launches = launches
        self.fused = fused
        self.flags = flags
        self._adapters = [(id(lora), strength) for lora, strength in plan.adapters]
        self._loras: list[weakref.ref] = []  # set by remember_recipe (with its callback)
        self._names = list(plan.params)
        # the patch objects themselves: their ids cannot be reused while the recipe holds them
        self._contribs = [(c.patch, c.rows, c.strength) for cs in plan.params.values()
                          for c in cs]
        # the launches hold these parameter objects and read their addresses when launched,
        # but took their shapes, strides and dtypes as they were: all must be unchanged
        self._params = [(params[n], _layout(params[n])) for n in fused]
        self._versions = [(t, t._version) for n in fused for c in plan.params[n]
                          for _, t in c.patch.tensors() if isinstance(t, torch.Tensor)]

    def matches(self, plan: MergePlan, params: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``plan`` over ``params`` would launch exactly :attr:`launches` again."""
        adapters = plan.adapters
        if len(adapters) != len(self._loras) or any(
                ref() is not lora or strength != s
                for ref, (lora, strength), (_, s) in zip(self._loras, adapters, self._adapters,
                                                         strict=True)):
            return False
        if list(plan.params) != self._names:
            return False
        contribs = self._contribs
        i = 0
        for cs in plan.params.values():
            for c in cs:
                patch, rows, strength = contribs[i]
                if c.patch is not patch or c.rows != rows or c.strength != strength:
                    return False
                i += 1
        if i != len(contribs):
            return False
        for (p, layout), name in zip(self._params, self.fused, strict=True):
            if params[name] is not p or _layout(p) != layout:
                return False
        return all(t._version == v for t, v in self._versions)


def _layout(p: torch.Tensor) -> tuple:
    """Where and how ``p``'s elements lie: address, device, shape, strides, dtype."""
    return p.data_ptr(), p.device, p.shape, p.stride(), p.dtype


def find_recipe(memo: MergeMemo, plan: MergePlan,
                params: Mapping[str, torch.Tensor]) -> MergeRecipe | None:
    """A recipe in a model's ``memo`` that ``plan`` would repeat exactly, or None."""
    for recipe in memo.recipes:
        if recipe.matches(plan, params):
            return recipe
    return None


def remember_recipe(memo: MergeMemo, recipe: MergeRecipe,
                    adapters: list[tuple[object, float]]) -> None:
    """Keep ``recipe`` in a model's ``memo`` (made from a plan of ``adapters``), replacing any
    recipe of the same adapters and strengths, and dropping the oldest beyond
    :data:`MAX_RECIPES`.
    """
    recipes = memo.recipes
    recipes[:] = [r for r in recipes if r._adapters != recipe._adapters]
    recipes.insert(0, recipe)
    del recipes[MAX_RECIPES:]
    memo_ref = weakref.ref(memo)

    def forget(_: weakref.ref) -> None:  # an adapter of the recipe died: free its tensors
        m = memo_ref()
        if m is not None and recipe in m.recipes:
            m.recipes.remove(recipe)

    recipe._loras = [weakref.ref(lora, forget) for lora, _ in adapters]
