"""Layer kinds: how a family of layers runs low-rank patches in a dynamic forward, registered
by layer class (a dict plus a decorator, found along the module's MRO).

Linear layers run the tiers over concatenated factors (:mod:`shuttle.apply.dynamic_layer`);
convolutions with zero padding and one group, and embeddings without ``max_norm``, run the
patch's own residual op; every other layer (or patch) joins the float32 weight residual.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from shuttle.patches import LowRank

__all__ = ["LAYER_KINDS", "LayerKind", "chain_dtype", "layer_kind", "register_layer_kind"]


def chain_dtype(*dtypes: torch.dtype, exact: bool = True) -> torch.dtype:
    """The dtype a low-rank update multiplies activations and factors in: the promotion of the
    activations' (or layer's) dtype, given first, and the factors' dtypes. Neither is narrowed:
    bf16 with bf16 stays bf16, fp16 with float32 is float32, fp16 with bf16 is float32 (an
    fp16 file on a bf16 layer: activations cast to fp16 would overflow past 65504).

    With ``exact=False`` (the lossless and fused tiers) fp16 factors on a bf16 layer run in
    bf16: bf16 holds fp16's whole range, so nothing overflows; the factors lose 3 mantissa bits
    once, at attach. Float32 factors would cost more than twice the update's time: float32
    GEMMs over x cast up, and an output added out of place (docs/dynamic.md, "Dtypes").
    """
    out = first = dtypes[0]
    for d in dtypes[1:]:
        if exact or not (first == torch.bfloat16 and d == torch.float16):
            out = torch.promote_types(out, d)
    return out


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """How a family of layers runs low-rank weight patches in a dynamic forward.

    ``takes(module, patch)``: whether ``patch`` runs as a low-rank residual next to the
    layer's own output (otherwise it joins the float32 weight residual ``W + request * R``,
    which runs the module's own forward and is right for any module). ``tiers``: the Linear
    tiers (exact / lossless / fused) over concatenated factors; otherwise the patch's own op
    (:meth:`~shuttle.patches.LowRank.residual`).
    """

    name: str
    takes: Callable[[torch.nn.Module, LowRank], bool]
    tiers: bool = False


# Layer class -> its kind, found along the module's MRO (a subclass takes its base's kind).
LAYER_KINDS: dict[type[torch.nn.Module], LayerKind] = {}
_OTHER = LayerKind("other", lambda module, patch: False)


def register_layer_kind(*classes: type[torch.nn.Module]) -> Callable[[LayerKind], LayerKind]:
    """Register ``kind`` for layers of ``classes`` (and their subclasses): ``register_layer_kind
    (MyLinear)(LayerKind("mylinear", takes=...))``.
    """

    def add(kind: LayerKind) -> LayerKind:
        for cls in classes:
            LAYER_KINDS[cls] = kind
        return kind

    return add


def layer_kind(module: torch.nn.Module) -> LayerKind:
    """The registered kind of ``module``'s class or nearest base class, else ``"other"``."""
    for cls in type(module).__mro__:
        kind = LAYER_KINDS.get(cls)
        if kind is not None:
            return kind
    return _OTHER


def _plain_forward(module: torch.nn.Module, base: type[torch.nn.Module]) -> bool:
    """Whether ``module`` runs ``base``'s own forward (a subclass that pads or reshapes its
    input first, such as a causal Conv3d, gets the weight residual instead).
    """
    return type(module).forward is base.forward


register_layer_kind(torch.nn.Linear)(LayerKind(
    "linear", lambda module, p: p.mid is None and not p.transposed, tiers=True))
for _conv in (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d):
    # The residual convolves x with the factors at the layer's stride, padding and dilation:
    # zero padding and one group only (another padding mode or grouped channels: W + R).
    register_layer_kind(_conv)(LayerKind(
        "conv", lambda module, p, base=_conv: (
            not p.transposed and module.groups == 1 and module.padding_mode == "zeros"
            and _plain_forward(module, base))))
register_layer_kind(torch.nn.Embedding)(LayerKind(
    "embedding", lambda module, p: (p.transposed and module.max_norm is None
                                    and _plain_forward(module, torch.nn.Embedding))))
