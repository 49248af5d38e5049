"""Widen a layer's input for an adapter that takes more input features than the layer has.

A FLUX.1 control LoRA (Canny, Depth) feeds the control image's latents in beside the noisy
ones, so its ``img_in`` factors take (3072, 128) where the model's ``x_embedder`` has
(3072, 64). As diffusers does (``_maybe_expand_transformer_param_shape_or_error_``), the weight
is padded with zero columns to the adapter's width before the update is merged: the old inputs
keep their weights, the new ones start at zero, the bias is left as it is, and the layer's
``in_features`` follows, as does the config attribute a model family names for it (diffusers'
Flux ``config.in_channels``, which ``FluxControlPipeline`` reads). The ``Parameter`` object
stays the same (only its ``data`` is swapped), so hooks, optimizers and ``named_parameters()``
holders keep it; :func:`narrow` swaps the original tensor back, untouched: bit for bit, with
``in_features`` and the config attribute restored.

Only merges widen (:func:`~shuttle.merge_lora`, ``apply_lora(mode="merge")``); planning for
any other entry point raises :class:`~shuttle.errors.WideningError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from shuttle.apply.plan import MergePlan
from shuttle.errors import WideningError
from shuttle.targets import ModelNames
from shuttle.targets.family import widenable
from shuttle.weights.plain import is_plain_tensor

__all__ = ["Widened", "narrow", "widen_layers"]


@dataclasses.dataclass(frozen=True)
class Widened:
    """One widened layer and what :func:`narrow` puts back."""

    param: torch.nn.Parameter
    original: torch.Tensor  # the weight's data before widening, never written
    module: torch.nn.Linear
    in_features: int
    config: Any = None  # the config whose attribute follows the width, and that attribute
    config_attr: str | None = None


def widen_layers(model: torch.nn.Module, plan: MergePlan,
                 params: Mapping[str, torch.Tensor]) -> list[Widened]:
    """Pad every weight in ``plan.widen`` with zero input columns, after checking them all.

    Args:
        model: the model the plan was made for.
        plan: a plan made with ``widen=True``.
        params: ``dict(model.named_parameters())``.

    Returns:
        What :func:`narrow` needs to undo it (empty when nothing widens).

    Raises:
        WideningError: a widened weight is not a plain floating-point ``nn.Linear`` weight;
            raised before any layer changes.
    """
    layers = []
    for name, shape in plan.widen.items():
        path, _, leaf = name.rpartition(".")
        module = model.get_submodule(path)
        p = params[name]
        if not (isinstance(module, torch.nn.Linear) and leaf == "weight"
                and isinstance(p, torch.nn.Parameter) and is_plain_tensor(p)):
            raise WideningError(
                f"the adapter widens {name!r} from {tuple(p.shape)} to {tuple(shape)}, but only "
                "the weight of a torch.nn.Linear holding a plain floating-point tensor can be "
                f"widened (this one is a {type(module).__qualname__}.{leaf} of "
                f"{type(p).__qualname__}); load the model unquantized, or pass mapping={{...}} "
                "to send the adapter key elsewhere. Nothing was changed.")
        layers.append((p, module, shape))
    attrs = widenable(ModelNames.of(model)) if layers else {}
    done: list[Widened] = []
    try:
        for (p, module, shape), name in zip(layers, plan.widen, strict=True):
            old = p.data
            wide = torch.zeros(shape, dtype=old.dtype, device=old.device)
            wide[:, : old.shape[1]].copy_(old)  # (out, in) -> (out, in'): new columns are 0
            config, attr = _config_of(model, name, attrs.get(name), module.in_features)
            done.append(Widened(p, old, module, module.in_features, config, attr))
            p.data = wide
            module.in_features = shape[1]
            if attr is not None:
                setattr(config, attr, shape[1])
    except BaseException:  # out of memory halfway: put back the ones already widened
        narrow(done)
        raise
    return done


def narrow(widened: list[Widened]) -> None:
    """Undo :func:`widen_layers`: each parameter gets its original tensor back (the very
    object, never written) and its layer its ``in_features``.
    """
    for w in reversed(widened):
        w.param.data = w.original
        w.module.in_features = w.in_features
        if w.config_attr is not None:
            setattr(w.config, w.config_attr, w.in_features)


def _config_of(model: torch.nn.Module, name: str, attr: str | None, width: int
               ) -> tuple[Any, str | None]:
    """The config (of the module holding the layer) whose ``attr`` records the layer's input
    width ``width``; (None, None) when there is none or it says another width.
    """
    if attr is None:
        return None, None
    layer_path = name.rpartition(".")[0]
    holder = model.get_submodule(layer_path.rpartition(".")[0])
    config = getattr(holder, "config", None)
    if config is None or getattr(config, attr, None) != width:
        return None, None
    return config, attr
