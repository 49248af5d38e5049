"""Stable Diffusion 3 / 3.5 names: Stability's MMDiT layout on diffusers' SD3Transformer2DModel.

Adapters trained on the original code (sd3-ref / sgm ``mmdit.py``: ``MMDiT`` with
``joint_blocks.N.x_block`` and ``joint_blocks.N.context_block``, each a ``DismantledBlock`` with
``attn.qkv``, ``attn.proj``, ``attn.ln_q``/``ln_k`` (3.5), ``mlp.fc1``/``fc2`` and
``adaLN_modulation.1``; SD 3.5 Medium's MMDiT-X adds ``x_block.attn2``; ``x_embedder.proj``,
``t_embedder.mlp``, ``y_embedder.mlp``, ``context_embedder``, ``final_layer``) come as
``diffusion_model.`` keys (ComfyUI, LyCORIS on the checkpoint) or in kohya sd-scripts' spelling
``lora_unet_joint_blocks_0_x_block_attn_qkv``. diffusers names the same layers as
``convert_sd3_transformer_checkpoint_to_diffusers`` (loaders/single_file_utils.py); diffusers
0.42.1 has no LoRA converter for these names (SD3LoraLoaderMixin reads diffusers names only).

The original fuses what diffusers keeps apart: ``attn.qkv`` is ``to_q, to_k, to_v`` stacked by
rows (``context_block``'s the ``add_*_proj``, ``attn2.qkv`` the ``attn2.to_*``); rows come from
the diffusers layers' own heights. The last joint block's context side is pre-only (no
``attn.proj``, no ``mlp``) and its ``adaLN_modulation.1`` stores (shift, scale) where diffusers'
``norm1_context.linear`` (an AdaLayerNormContinuous) stores (scale, shift): the row halves
swap, as they do for ``final_layer.adaLN_modulation.1`` onto ``norm_out.linear``.
"""

from __future__ import annotations

from shuttle.targets.family import register_family
from shuttle.targets.family_table import (
    Layout,
    Placed,
    Table,
    family_table,
    half_swap,
    layout_spelling,
    layout_table,
    respelled_reverse,
    swapped_halves,
)
from shuttle.targets.names import ModelNames
from shuttle.targets.split import MappingValue

__all__ = ["sd3_names", "sd3_original_names"]

# One-to-one layers below ``joint_blocks.N.`` (original -> diffusers ``transformer_blocks.N.``).
_BLOCK = {
    "x_block.attn.proj": "attn.to_out.0", "context_block.attn.proj": "attn.to_add_out",
    "x_block.attn.ln_q": "attn.norm_q", "x_block.attn.ln_k": "attn.norm_k",
    "context_block.attn.ln_q": "attn.norm_added_q", "context_block.attn.ln_k": "attn.norm_added_k",
    "x_block.mlp.fc1": "ff.net.0.proj", "x_block.mlp.fc2": "ff.net.2",
    "context_block.mlp.fc1": "ff_context.net.0.proj", "context_block.mlp.fc2": "ff_context.net.2",
    # a dual-attention (MMDiT-X) block's x_block modulation gives 9 chunks, in the same order
    "x_block.adaLN_modulation.1": "norm1.linear",
    "x_block.attn2.proj": "attn2.to_out.0",
    "x_block.attn2.ln_q": "attn2.norm_q", "x_block.attn2.ln_k": "attn2.norm_k",
}
_TOP = {
    "x_embedder.proj": "pos_embed.proj",
    "t_embedder.mlp.0": "time_text_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_text_embed.timestep_embedder.linear_2",
    "y_embedder.mlp.0": "time_text_embed.text_embedder.linear_1",
    "y_embedder.mlp.2": "time_text_embed.text_embedder.linear_2",
    "context_embedder": "context_embedder",
    "final_layer.linear": "proj_out",
}
_QKV = {"x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
        "x_block.attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v")}


def _context_modulation(names: ModelNames, paths: tuple[str, ...]) -> MappingValue | None:
    """A block's context adaLN onto ``norm1_context.linear``: as is, or in a pre-only block
    (the last: no context output projection) its (shift, scale) halves swapped.
    """
    (mod,) = paths
    block = mod.removesuffix("norm1_context.linear")
    return mod if names.has_module(f"{block}attn.to_add_out") else half_swap(names, mod)


# Original path template -> diffusers place (fused qkv layers: the layers their rows stack).
_LAYOUT: Layout = (
    {f"joint_blocks.{{i}}.{o}": f"transformer_blocks.{{i}}.{d}" for o, d in _BLOCK.items()}
    | {f"joint_blocks.{{i}}.{o}": tuple(f"transformer_blocks.{{i}}.{d}" for d in ds)
       for o, ds in _QKV.items()}
    | {"joint_blocks.{i}.context_block.adaLN_modulation.1":
       Placed("transformer_blocks.{i}.norm1_context.linear", _context_modulation)}
    | _TOP | {"final_layer.adaLN_modulation.1": swapped_halves("norm_out.linear")})


def _root(names: ModelNames) -> str | None:
    for root in names.roots:
        if (f"{root}transformer_blocks.0.attn.add_q_proj.weight" in names.shapes
                and f"{root}pos_embed.proj.weight" in names.shapes
                and f"{root}time_text_embed.text_embedder.linear_1.weight" in names.shapes
                and f"{root}transformer_blocks.0.norm1_context.linear.weight" in names.shapes):
            return root
    return None


@register_family
@family_table
def sd3_names(names: ModelNames) -> Table | None:
    """Original module path -> diffusers place, for a diffusers SD3/3.5 transformer (or None).

    SD 3 has no qk norms and most blocks no ``attn2``: those places are left out.
    """
    root = _root(names)
    return None if root is None else layout_table(names, root, _LAYOUT)


sd3_original_names = register_family(respelled_reverse(
    sd3_names.__wrapped__, ("joint_blocks.0.x_block.attn.qkv.weight", "x_embedder.proj.weight"),
    layout_spelling(_LAYOUT)))
