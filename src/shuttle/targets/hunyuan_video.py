"""HunyuanVideo names: Tencent's original layout on diffusers' HunyuanVideoTransformer3DModel.

Adapters trained on the original code (``hyvideo/modules/models.py``:
``HYVideoDiffusionTransformer`` with ``double_blocks.N.img_attn_qkv``, ``img_mlp.fc1``,
``img_mod.linear``, ``single_blocks.N.linear1``, ``modulation.linear``; ``token_refiner.py``'s
``txt_in``) come as ``diffusion_model.``/``transformer.`` keys (diffusion-pipe, finetrainers)
or in musubi-tuner's kohya spelling ``lora_unet_double_blocks_0_img_attn_qkv``. diffusers'
names follow
``convert_hunyuan_video_transformer_to_diffusers`` (loaders/single_file_utils.py) and
``_convert_hunyuan_video_lora_to_diffusers`` (loaders/lora_conversion_utils.py).

Like FLUX.1 (:mod:`shuttle.targets.flux`), the original fuses what diffusers keeps apart:
``img_attn_qkv`` is ``to_q, to_k, to_v`` stacked by rows (``txt_attn_qkv`` the ``add_*_proj``,
the token refiner's ``self_attn_qkv`` its ``to_q/k/v``), and ``single_blocks.N.linear1`` is
``to_q, to_k, to_v, proj_mlp`` stacked; rows come from the diffusers layers' own heights. The
final adaLN projection stores (shift, scale) where diffusers' ``norm_out.linear`` stores
(scale, shift), so its row halves swap.
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
    swapped_halves,
)
from shuttle.targets.names import ModelNames

__all__ = ["hunyuan_video_names", "hunyuan_video_original_names"]

# One-to-one layers below ``double_blocks.N.`` (original -> diffusers ``transformer_blocks.N.``).
_DOUBLE = {
    "img_attn_proj": "attn.to_out.0", "txt_attn_proj": "attn.to_add_out",
    "img_attn_q_norm": "attn.norm_q", "img_attn_k_norm": "attn.norm_k",
    "txt_attn_q_norm": "attn.norm_added_q", "txt_attn_k_norm": "attn.norm_added_k",
    "img_mlp.fc1": "ff.net.0.proj", "img_mlp.fc2": "ff.net.2",
    "txt_mlp.fc1": "ff_context.net.0.proj", "txt_mlp.fc2": "ff_context.net.2",
    "img_mod.linear": "norm1.linear", "txt_mod.linear": "norm1_context.linear",
}
# Below ``single_blocks.N.`` (-> ``single_transformer_blocks.N.``).
_SINGLE = {"linear2": "proj_out", "modulation.linear": "norm.linear",
           "q_norm": "attn.norm_q", "k_norm": "attn.norm_k"}
# Below ``txt_in.individual_token_refiner.blocks.N.`` (-> ``context_embedder.token_refiner.
# refiner_blocks.N.``); the refiner's adaLN gives (gate_msa, gate_mlp) in both, no swap.
_REFINER = {"norm1": "norm1", "norm2": "norm2", "self_attn_proj": "attn.to_out.0",
            "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2",
            "adaLN_modulation.1": "norm_out.linear"}
_TOP = {
    "img_in.proj": "x_embedder.proj",
    "time_in.mlp.0": "time_text_embed.timestep_embedder.linear_1",
    "time_in.mlp.2": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.mlp.0": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.mlp.2": "time_text_embed.guidance_embedder.linear_2",
    "txt_in.input_embedder": "context_embedder.proj_in",
    "txt_in.t_embedder.mlp.0": "context_embedder.time_text_embed.timestep_embedder.linear_1",
    "txt_in.t_embedder.mlp.2": "context_embedder.time_text_embed.timestep_embedder.linear_2",
    "txt_in.c_embedder.linear_1": "context_embedder.time_text_embed.text_embedder.linear_1",
    "txt_in.c_embedder.linear_2": "context_embedder.time_text_embed.text_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
_ADDED_QKV = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")
_LINEAR1 = (*_QKV, "proj_mlp")
_REFINER_BLOCK = "txt_in.individual_token_refiner.blocks.{i}."
_DIFFUSERS_REFINER = "context_embedder.token_refiner.refiner_blocks.{i}."

# Original path template -> diffusers place (fused layers: the layers their rows stack).
_LAYOUT: Layout = (
    {f"double_blocks.{{i}}.{o}": f"transformer_blocks.{{i}}.{d}" for o, d in _DOUBLE.items()}
    | {"double_blocks.{i}.img_attn_qkv": tuple(f"transformer_blocks.{{i}}.{d}" for d in _QKV),
       "double_blocks.{i}.txt_attn_qkv":
       tuple(f"transformer_blocks.{{i}}.{d}" for d in _ADDED_QKV)}
    | {f"single_blocks.{{i}}.{o}": f"single_transformer_blocks.{{i}}.{d}"
       for o, d in _SINGLE.items()}
    | {"single_blocks.{i}.linear1": tuple(f"single_transformer_blocks.{{i}}.{d}"
                                          for d in _LINEAR1)}
    | {_REFINER_BLOCK + o: _DIFFUSERS_REFINER + d for o, d in _REFINER.items()}
    | {_REFINER_BLOCK + "self_attn_qkv": tuple(_DIFFUSERS_REFINER + d for d in _QKV)}
    | _TOP | {"final_layer.adaLN_modulation.1": swapped_halves("norm_out.linear")})


def _root(names: ModelNames) -> str | None:
    for root in names.roots:
        if (f"{root}transformer_blocks.0.attn.to_q.weight" in names.shapes
                and f"{root}context_embedder.token_refiner.refiner_blocks.0.attn.to_q.weight"
                in names.shapes and f"{root}x_embedder.proj.weight" in names.shapes):
            return root
    return None


@register_family
@family_table
def hunyuan_video_names(names: ModelNames) -> Table | None:
    """Original module path -> diffusers place, for a diffusers HunyuanVideo model (or None)."""
    root = _root(names)
    return None if root is None else layout_table(names, root, _LAYOUT)


hunyuan_video_original_names = register_family(respelled_reverse(
    hunyuan_video_names.__wrapped__,
    ("double_blocks.0.img_attn_qkv.weight",
     "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"), layout_spelling(_LAYOUT)))
