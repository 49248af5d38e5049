"""Wan 2.1 / 2.2 names: the original Wan-Video layout on diffusers' WanTransformer3DModel.

Adapters trained on the original code (``wan/modules/model.py``: ``WanModel`` with
``blocks.N.self_attn.q``, ``cross_attn.k_img``, ``ffn.0``, ``norm3``, ``modulation``;
``head.head``, ``text_embedding``, ``time_embedding``, ``time_projection``, ``img_emb.proj``)
come as ``diffusion_model.`` keys (ComfyUI, lightx2v, CausVid, DiffSynth) or as musubi-tuner's
kohya spelling ``lora_unet_blocks_0_self_attn_q``. diffusers names the same layers as in
``convert_wan_transformer_to_diffusers`` (loaders/single_file_utils.py) for checkpoints and
``_convert_non_diffusers_wan_lora_to_diffusers`` / ``_convert_musubi_wan_lora_to_diffusers``
(loaders/lora_conversion_utils.py) for LoRAs. Every layer keeps its shape; only the names move,
and two LayerNorms trade names (Wan's affine ``norm3`` is diffusers' ``norm2``).

Both directions: :func:`wan_names` for a diffusers model, :func:`wan_original_names` for a model
in the original names (diffusers-named adapters, ``transformer.blocks.0.attn1.to_q``, onto
``blocks.0.self_attn.q``).
"""

from __future__ import annotations

import re

from shuttle.targets.family import register_family
from shuttle.targets.family_table import Table, family_table, respelled_reverse
from shuttle.targets.names import ModelNames

__all__ = ["wan_names", "wan_original_names"]

# Block layers: diffusers path below ``blocks.N.`` -> Wan path below ``blocks.N.``.
_BLOCK = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o", "attn1.norm_q": "self_attn.norm_q",
    "attn1.norm_k": "self_attn.norm_k",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o", "attn2.norm_q": "cross_attn.norm_q",
    "attn2.norm_k": "cross_attn.norm_k",
    # image-to-video (Wan 2.1 I2V/FLF2V): the CLIP image tokens' own key/value projections
    "attn2.add_k_proj": "cross_attn.k_img", "attn2.add_v_proj": "cross_attn.v_img",
    "attn2.norm_added_k": "cross_attn.norm_k_img",
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
    "norm2": "norm3",  # the affine LayerNorm before cross-attention
    "scale_shift_table": "modulation",  # a bare (1, 6, dim) parameter
}
_TOP = {
    "proj_out": "head.head", "scale_shift_table": "head.modulation",
    "patch_embedding": "patch_embedding",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    "condition_embedder.image_embedder.pos_embed": "img_emb.emb_pos",  # FLF2V
}
_IN_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def _root(names: ModelNames) -> str | None:
    for root in names.roots:
        if (f"{root}blocks.0.attn1.to_q.weight" in names.shapes
                and f"{root}condition_embedder.time_proj.weight" in names.shapes):
            return root
    return None


@register_family
@family_table
def wan_names(names: ModelNames) -> Table | None:
    """Wan module path -> diffusers module path, for a diffusers Wan transformer (or None).

    The bare parameters (``modulation``, ``head.modulation``, ``img_emb.emb_pos``) map to the
    parameter itself, which is its own module for resolution.
    """
    root = _root(names)
    if root is None:
        return None
    table = {}
    for path in list(names.modules) + list(names.shapes):
        if not path.startswith(root):
            continue
        rel = path[len(root):]
        if rel in _TOP:
            table[_TOP[rel]] = path
        elif (m := _IN_BLOCK.fullmatch(rel)) and m.group(2) in _BLOCK:
            table[f"blocks.{m.group(1)}.{_BLOCK[m.group(2)]}"] = path
    return table


# Wan -> diffusers, the tables above turned around.
_SPELLING = ({f"blocks.{{i}}.{wan}": f"blocks.{{i}}.{d}" for d, wan in _BLOCK.items()}
             | {wan: d for d, wan in _TOP.items()})


wan_original_names = register_family(respelled_reverse(
    wan_names.__wrapped__, ("blocks.0.self_attn.q.weight", "time_projection.1.weight"), _SPELLING))
