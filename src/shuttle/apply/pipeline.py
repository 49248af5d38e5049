"""Pipelines as models: ``merge_lora(pipe, ...)`` on a diffusers pipeline's components.

A pipeline is not an ``nn.Module``; its modules are its components (``pipe.components``:
``transformer``, ``text_encoder``, ``text_encoder_2``, ``vae``, ...). :func:`as_model` puts them
under their component names in one module tree, the same parameter objects, nothing copied, so
that key resolution routes each adapter key to its component as the offloaded pipeline's
``set_loras`` does (``lora_te2_`` keys to ``text_encoder_2``, ``transformer.`` keys to the
transformer), and a per-component strength (``{"transformer": 0.8, "text_encoder": 0.5}``)
names them.

The tree of a pipeline is kept (weakly) with it while its components stay the same, so that
merges on the same pipeline share what they remember of a model (scoped merges' order, repeated
merges' launches).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from shuttle.errors import UnsupportedModelError

__all__ = ["Pipeline", "PipelineModules", "as_model"]

# A diffusers pipeline, or anything else with a ``components`` mapping of modules.
Pipeline = Any


class PipelineModules(torch.nn.Module):
    """A pipeline's ``nn.Module`` components as children named after them."""

    def __init__(self, components: Mapping[str, torch.nn.Module]):
        super().__init__()
        for name, module in components.items():
            self.add_module(name, module)

    def same_components(self, components: Mapping[str, torch.nn.Module]) -> bool:
        """Whether this tree still holds exactly ``components``."""
        mine = dict(self.named_children())
        return mine.keys() == components.keys() and all(
            mine[k] is v for k, v in components.items())


_TREES: weakref.WeakKeyDictionary[Any, PipelineModules] = weakref.WeakKeyDictionary()


def as_model(model: Any) -> torch.nn.Module:
    """``model`` itself when it is an ``nn.Module``; for a diffusers pipeline (anything with a
    ``components`` mapping), its modules as one :class:`PipelineModules`.

    Raises:
        UnsupportedModelError: neither, or a pipeline without any ``nn.Module`` component.
    """
    if isinstance(model, torch.nn.Module):
        return model
    components = getattr(model, "components", None)
    if not isinstance(components, Mapping):
        raise UnsupportedModelError(
            f"expected an nn.Module or a diffusers pipeline, got {type(model).__name__}; pass "
            "the model (e.g. pipe.transformer) or the pipeline itself")
    modules = {k: v for k, v in components.items() if isinstance(v, torch.nn.Module)}
    if not modules:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no nn.Module components ({sorted(components)}); "
            "nothing could take an adapter")
    tree = _TREES.get(model)
    if tree is None or not tree.same_components(modules):
        tree = PipelineModules(modules)
        _TREES[model] = tree
    return tree
