"""Chroma names: lodestones' FLUX.1-derived layout on diffusers' ChromaTransformer2DModel.

Chroma (``src/models/chroma/model.py`` in lodestones/flow) is FLUX.1 with the per-block
modulation layers pruned (no ``img_mod``/``txt_mod``/``modulation``, no final adaLN): one
``distilled_guidance_layer`` (an MLP "approximator": ``in_proj``, ``layers.N.in_layer``/
``out_layer``, ``norms.N``, ``out_proj``) computes every block's modulation. Adapters in these
names come as ``diffusion_model.`` keys (ComfyUI, diffusion-pipe, ai-toolkit) or in kohya
sd-scripts' spelling ``lora_unet_double_blocks_0_img_attn_qkv``. diffusers names the layers as
``convert_chroma_transformer_checkpoint_to_diffusers`` (loaders/single_file_utils.py) does;
Chroma's pipeline reads LoRAs with FluxLoraLoaderMixin (``_convert_kohya_flux_lora_to_diffusers``
for kohya names), which knows the blocks but not the approximator.

As in FLUX.1 (:mod:`shuttle.targets.flux`, which also places the block layers on this model),
``img_attn.qkv``/``txt_attn.qkv`` are ``to_q, to_k, to_v``/``add_*_proj`` stacked by rows and
``single_blocks.N.linear1`` is ``to_q, to_k, to_v, proj_mlp`` stacked; rows come from the
diffusers layers' heights. This table is complete on its own: it also covers the approximator
and the RMSNorms (Chroma's ``query_norm.scale`` is diffusers' ``norm_q.weight``).
"""

from __future__ import annotations

from shuttle.targets.family import register_family
from shuttle.targets.family_table import (
    Layout,
    Table,
    family_table,
    layout_spelling,
    layout_table,
    respelled_reverse,
)
from shuttle.targets.names import ModelNames

__all__ = ["chroma_names", "chroma_original_names"]

# One-to-one layers below ``double_blocks.N.`` (original -> diffusers ``transformer_blocks.N.``).
_DOUBLE = {
    "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
    "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2",
}
# Below ``single_blocks.N.`` (-> ``single_transformer_blocks.N.``).
_SINGLE = {"linear2": "proj_out", "norm.query_norm": "attn.norm_q",
           "norm.key_norm": "attn.norm_k"}
# Below ``distilled_guidance_layer.layers.N.`` (-> the same path): PixArt-style MLP names.
_APPROXIMATOR = {"in_layer": "linear_1", "out_layer": "linear_2"}
_TOP = {"img_in": "x_embedder", "txt_in": "context_embedder", "final_layer.linear": "proj_out",
        "distilled_guidance_layer.in_proj": "distilled_guidance_layer.in_proj",
        "distilled_guidance_layer.out_proj": "distilled_guidance_layer.out_proj"}
_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_LINEAR1 = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")

# Original path template -> diffusers place (fused layers: the layers their rows stack).
_LAYOUT: Layout = (
    {f"double_blocks.{{i}}.{o}": f"transformer_blocks.{{i}}.{d}" for o, d in _DOUBLE.items()}
    | {f"double_blocks.{{i}}.{o}": tuple(f"transformer_blocks.{{i}}.{d}" for d in ds)
       for o, ds in _QKV.items()}
    | {f"single_blocks.{{i}}.{o}": f"single_transformer_blocks.{{i}}.{d}"
       for o, d in _SINGLE.items()}
    | {"single_blocks.{i}.linear1": tuple(f"single_transformer_blocks.{{i}}.{d}"
                                          for d in _LINEAR1)}
    | {f"distilled_guidance_layer.layers.{{i}}.{o}": f"distilled_guidance_layer.layers.{{i}}.{d}"
       for o, d in _APPROXIMATOR.items()}
    | {"distilled_guidance_layer.norms.{i}": "distilled_guidance_layer.norms.{i}"}
    | _TOP)


def _root(names: ModelNames) -> str | None:
    for root in names.roots:
        if (f"{root}distilled_guidance_layer.in_proj.weight" in names.shapes
                and f"{root}single_transformer_blocks.0.proj_mlp.weight" in names.shapes
                and f"{root}transformer_blocks.0.attn.add_q_proj.weight" in names.shapes):
            return root
    return None


@register_family
@family_table
def chroma_names(names: ModelNames) -> Table | None:
    """Original module path -> diffusers place, for a diffusers Chroma transformer (or None)."""
    root = _root(names)
    return None if root is None else layout_table(names, root, _LAYOUT)


chroma_original_names = register_family(respelled_reverse(
    chroma_names.__wrapped__,
    ("distilled_guidance_layer.in_proj.weight", "single_blocks.0.linear1.weight"),
    layout_spelling(_LAYOUT)))
