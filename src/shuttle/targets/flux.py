"""FLUX.1 transformer names: Black Forest Labs' layout and diffusers' layout, both ways.

BFL fuses what diffusers keeps apart: ``double_blocks.N.img_attn.qkv`` is diffusers'
``transformer_blocks.N.attn.to_q/to_k/to_v`` stacked by rows, and ``single_blocks.N.linear1`` is
``to_q, to_k, to_v, proj_mlp`` stacked (hidden h, MLP width m: rows ``0:h, h:2h, 2h:3h,
3h:3h+m``). The final adaLN projection stores (shift, scale) in BFL and (scale, shift) in
diffusers, so its two row halves swap. An adapter in one layout applies to a model in the other
through this table: a fused adapter module is split by rows over the separate layers, separate
adapter modules land on rows of the fused weight. Either spelling of the adapter's names works
(dotted, or kohya's underscores). Low-rank modules split by the rows of their up factor, LoKr
and LoHa ones (as Flux LyCORIS trainers write them) by the rows of their whole float32 update,
DoRA ones by rows when the magnitude is per output row (:func:`shuttle.patches.select_rows`); a
DoRA normalizing input columns spans every split layer, and merging refuses it.

The attention's RMSNorm weights are BFL's ``...norm.query_norm.scale`` / ``key_norm.scale`` and
diffusers' ``attn.norm_q.weight`` / ``norm_k`` (``norm_added_q`` / ``norm_added_k`` for the text
stream of a double block): a BFL control LoRA's norm replacements land on them under the
parameter's other name.
"""

from __future__ import annotations

from shuttle.targets.family import register_family, register_widenable
from shuttle.targets.family_table import (
    Layout,
    Placed,
    Table,
    family_table,
    layout_spelling,
    layout_table,
    respelled_reverse,
    swapped_halves,
)
from shuttle.targets.names import ModelNames
from shuttle.targets.split import MappingValue, Split

__all__ = ["flux_names", "flux_original_names", "flux_widenable"]

# One-to-one layers: BFL path -> diffusers path, below ``double_blocks.N.`` /
# ``transformer_blocks.N.``, ``single_blocks.N.`` / ``single_transformer_blocks.N.``, the root.
_DOUBLE = {
    "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2",
    "img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
}
_SINGLE = {"linear2": "proj_out", "modulation.lin": "norm.linear"}
_TOP = {
    "img_in": "x_embedder", "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
# RMSNorms of q and k (BFL's parameter is ``scale`` where diffusers' is ``weight``).
_DOUBLE_NORMS = {
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
}
_SINGLE_NORMS = {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}
_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_LINEAR1 = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")


def _norm(names: ModelNames, paths: tuple[str, ...]) -> MappingValue:
    """A BFL RMSNorm onto diffusers' ``norm_q``/``norm_k``: its ``scale`` is their ``weight``."""
    return [Split(paths[0], params=(("scale", "weight"),))]


# BFL path template -> diffusers place (fused layers: the layers their rows stack).
_LAYOUT: Layout = (
    {f"double_blocks.{{i}}.{o}": f"transformer_blocks.{{i}}.{d}" for o, d in _DOUBLE.items()}
    | {f"double_blocks.{{i}}.{o}": tuple(f"transformer_blocks.{{i}}.{d}" for d in ds)
       for o, ds in _QKV.items()}
    | {f"double_blocks.{{i}}.{o}": Placed(f"transformer_blocks.{{i}}.{d}", _norm)
       for o, d in _DOUBLE_NORMS.items()}
    | {f"single_blocks.{{i}}.{o}": f"single_transformer_blocks.{{i}}.{d}"
       for o, d in _SINGLE.items()}
    | {"single_blocks.{i}.linear1": tuple(f"single_transformer_blocks.{{i}}.{d}"
                                          for d in _LINEAR1)}
    | {f"single_blocks.{{i}}.{o}": Placed(f"single_transformer_blocks.{{i}}.{d}", _norm)
       for o, d in _SINGLE_NORMS.items()}
    | _TOP | {"final_layer.adaLN_modulation.1": swapped_halves("norm_out.linear")})
# Parameters of a BFL Flux transformer, below its root.
_BFL = ("double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight")


def _root(names: ModelNames) -> str | None:
    """The root of a diffusers Flux transformer among the model's names, or None."""
    for root in names.roots:
        if (f"{root}transformer_blocks.0.attn.to_q.weight" in names.shapes
                and f"{root}single_transformer_blocks.0.proj_mlp.weight" in names.shapes):
            return root
    return None


@register_family
@family_table
def flux_names(names: ModelNames) -> Table | None:
    """BFL module path -> diffusers place, for a diffusers Flux transformer (or None)."""
    root = _root(names)
    return None if root is None else layout_table(names, root, _LAYOUT)


def _bands(names: ModelNames, root: str, n: int, weight: tuple[int, ...]) -> list[int]:
    """Heights of the layers a BFL fused weight stacks: q, k, v each a third of a double block's
    ``qkv`` (hidden h), ``linear1``'s MLP the rest (``3h + m`` rows).
    """
    h = names.shapes[f"{root}{_BFL[0]}"][0] // 3
    return [h, h, h] if n == 3 else [h, h, h, weight[0] - 3 * h]


# diffusers module path -> BFL place, for a model in BFL's layout: the same table turned around.
flux_original_names = register_family(respelled_reverse(
    flux_names.__wrapped__, _BFL, layout_spelling(_LAYOUT), _bands))


@register_widenable
def flux_widenable(names: ModelNames) -> dict[str, str | None]:
    """The input embedder (``x_embedder`` / ``img_in``), which a control LoRA (Canny, Depth)
    widens from 64 to 128 input channels: the control image's latents beside the noisy ones.
    diffusers' transformer records that width as ``config.in_channels`` (``FluxControlPipeline``
    reads it to size its latents), as diffusers' own loader sets it.
    """
    root = _root(names)
    if root is not None:
        return {f"{root}x_embedder.weight": "in_channels"}
    for root in names.roots:
        if all(f"{root}{p}" in names.shapes for p in _BFL):
            return {f"{root}img_in.weight": None}
    return {}
