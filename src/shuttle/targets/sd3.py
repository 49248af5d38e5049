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

import re

from shuttle.targets.family import register_family
from shuttle.targets.family_table import (
    Table,
    family_table,
    half_swap,
    respelled_reverse,
    stacked,
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
_INDEX = re.compile(r"transformer_blocks\.(\d+)\.")


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
    """Original module path -> diffusers place, for a diffusers SD3/3.5 transformer (or None)."""
    root = _root(names)
    if root is None:
        return None
    blocks = {int(m.group(1)) for path in names.modules
              if path.startswith(root) and (m := _INDEX.match(path[len(root):]))}
    table: dict[str, MappingValue | None] = {}
    for i in blocks:
        new, old = f"{root}transformer_blocks.{i}.", f"joint_blocks.{i}."
        table |= {old + o: new + d for o, d in _BLOCK.items()}
        table |= {old + o: stacked(names, [new + d for d in ds]) for o, ds in _QKV.items()}
        mod = f"{new}norm1_context.linear"
        # pre-only (the last block): no context output projection, a (shift, scale) modulation
        pre_only = not names.has_module(f"{new}attn.to_add_out")
        table[old + "context_block.adaLN_modulation.1"] = (
            half_swap(names, mod) if pre_only else mod)
    table |= {o: root + d for o, d in _TOP.items()}
    table["final_layer.adaLN_modulation.1"] = half_swap(names, f"{root}norm_out.linear")
    # Keep what this model has: SD 3 has no qk norms, most blocks no attn2.
    return {o: v for o, v in table.items()
            if v is not None and (not isinstance(v, str) or names.has_module(v))}


# Original -> diffusers, the tables above turned around (fused qkv layers cut in three).
_SPELLING = ({f"joint_blocks.{{i}}.{o}": f"transformer_blocks.{{i}}.{d}" for o, d in _BLOCK.items()}
             | {f"joint_blocks.{{i}}.{o}": tuple(f"transformer_blocks.{{i}}.{d}" for d in ds)
                for o, ds in _QKV.items()}
             | {"joint_blocks.{i}.context_block.adaLN_modulation.1":
                "transformer_blocks.{i}.norm1_context.linear",
                "final_layer.adaLN_modulation.1": "norm_out.linear"}
             | _TOP)


sd3_original_names = register_family(respelled_reverse(
    sd3_names.__wrapped__, ("joint_blocks.0.x_block.attn.qkv.weight", "x_embedder.proj.weight"),
    _SPELLING))
