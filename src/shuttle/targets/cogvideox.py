"""CogVideoX names: THUDM's original (SAT) layout on diffusers' CogVideoXTransformer3DModel.

Adapters trained on the original SwissArmyTransformer code (``sat/dit_video_concat.py``) name
layers after its ``BaseTransformer`` and mixins: ``transformer.layers.N.attention.
query_key_value``, ``.attention.dense``, ``.mlp.dense_h_to_4h``/``dense_4h_to_h``,
``mixins.adaln_layer.adaLN_modulations.N.1``, ``mixins.patch_embed.proj``, ``time_embed.0``,
``mixins.final_layer.linear``, ... and come as ``model.diffusion_model.``/``diffusion_model.``
keys or in a kohya spelling. diffusers' names follow its conversion script
(``scripts/convert_cogvideox_to_diffusers.py``: ``TRANSFORMER_KEYS_RENAME_DICT`` and
``TRANSFORMER_SPECIAL_KEYS_REMAP``).

Two original layers are fused where diffusers keeps them apart: ``query_key_value`` is ``to_q,
to_k, to_v`` stacked by rows (equal thirds), and each block's ``adaLN_modulations.N.1`` gives 12
equal chunks, of which diffusers' ``norm1.linear`` holds chunks 0-2 and 6-8 and ``norm2.linear``
chunks 3-5 and 9-11 (in that order). The final ``adaLN_modulation.1`` is ``norm_out.linear``
row for row (diffusers' ``AdaLayerNorm(chunk_dim=1)`` reads SAT's (shift, scale) order).
"""

from __future__ import annotations

from shuttle.targets.family import register_family
from shuttle.targets.family_table import (
    Layout,
    Placed,
    Table,
    family_table,
    layout_spelling,
    layout_table,
    respelled_reverse,
)
from shuttle.targets.names import ModelNames
from shuttle.targets.split import MappingValue, Split

__all__ = ["cogvideox_names", "cogvideox_original_names"]

# One-to-one layers below ``transformer.layers.N.`` (original -> diffusers
# ``transformer_blocks.N.``).
_BLOCK = {"attention.dense": "attn1.to_out.0", "mlp.dense_h_to_4h": "ff.net.0.proj",
          "mlp.dense_4h_to_h": "ff.net.2", "input_layernorm": "norm1.norm",
          "post_attention_layernorm": "norm2.norm"}
# Per-block layers the original keeps in its adaLN mixin, indexed by block.
_MIXIN = {"mixins.adaln_layer.query_layernorm_list.{i}": "attn1.norm_q",
          "mixins.adaln_layer.key_layernorm_list.{i}": "attn1.norm_k"}
_TOP = {
    "mixins.patch_embed.proj": "patch_embed.proj",
    "mixins.patch_embed.text_proj": "patch_embed.text_proj",
    "time_embed.0": "time_embedding.linear_1",
    "time_embed.2": "time_embedding.linear_2",
    "ofs_embed.0": "ofs_embedding.linear_1",  # CogVideoX 1.5 I2V
    "ofs_embed.2": "ofs_embedding.linear_2",
    "transformer.final_layernorm": "norm_final",
    "mixins.final_layer.norm_final": "norm_out.norm",
    "mixins.final_layer.linear": "proj_out",
    "mixins.final_layer.adaLN_modulation.1": "norm_out.linear",
}
_QKV = ("attn1.to_q", "attn1.to_k", "attn1.to_v")
# Chunks (of 12) of ``adaLN_modulations.N.1`` each norm's linear holds, in its row order.
_ADALN = {"norm1.linear": (0, 1, 2, 6, 7, 8), "norm2.linear": (3, 4, 5, 9, 10, 11)}


def _root(names: ModelNames) -> str | None:
    for root in names.roots:
        if all(f"{root}{p}.weight" in names.shapes for p in (
                "patch_embed.text_proj", "time_embedding.linear_1", "norm_final",
                "transformer_blocks.0.attn1.to_q", "transformer_blocks.0.norm1.linear",
                "transformer_blocks.0.norm2.linear")):
            return root
    return None


def _thirds(names: ModelNames, paths: tuple[str, ...]) -> MappingValue | None:
    """``query_key_value``'s rows onto ``to_q``, ``to_k``, ``to_v`` (equal heights)."""
    heights = [names.shapes.get(f"{p}.weight") for p in paths]
    if any(h is None for h in heights) or len({h[0] for h in heights}) != 1:
        return None
    h = heights[0][0]
    return [Split(p, (i * h, (i + 1) * h)) for i, p in enumerate(paths)]


def _adaln(names: ModelNames, paths: tuple[str, ...]) -> MappingValue | None:
    """``adaLN_modulations.N.1``'s 12 chunks onto ``norm1.linear`` and ``norm2.linear``."""
    shapes = [names.shapes.get(f"{p}.weight") for p in paths]
    if any(s is None for s in shapes) or shapes[0][0] != shapes[1][0] or shapes[0][0] % 6:
        return None
    c = shapes[0][0] // 6
    return [Split(path, (chunk * c, (chunk + 1) * c), (j * c, (j + 1) * c))
            for path, chunks in zip(paths, _ADALN.values(), strict=True)
            for j, chunk in enumerate(chunks)]


# Original path template -> diffusers place. The original spelled the diffusers way cuts qkv in
# thirds and the adaLN's 12 chunks in two halves (a name and a height for each norm's linear);
# the functions place the rows.
_LAYOUT: Layout = (
    {f"transformer.layers.{{i}}.{o}": f"transformer_blocks.{{i}}.{d}" for o, d in _BLOCK.items()}
    | {o: f"transformer_blocks.{{i}}.{d}" for o, d in _MIXIN.items()}
    | {"transformer.layers.{i}.attention.query_key_value":
       Placed(tuple(f"transformer_blocks.{{i}}.{d}" for d in _QKV), _thirds),
       "mixins.adaln_layer.adaLN_modulations.{i}.1":
       Placed(tuple(f"transformer_blocks.{{i}}.{d}" for d in _ADALN), _adaln)}
    | _TOP)


@register_family
@family_table
def cogvideox_names(names: ModelNames) -> Table | None:
    """Original (SAT) module path -> diffusers place, for a diffusers CogVideoX model (or None).

    CogVideoX-5b-I2V's ``mixins.pos_embed.pos_embedding`` is a buffer in diffusers, not a
    parameter, so it is no place; a layer the model lacks (no ofs embedding) is none either.
    """
    root = _root(names)
    return None if root is None else layout_table(names, root, _LAYOUT)


cogvideox_original_names = register_family(respelled_reverse(
    cogvideox_names.__wrapped__,
    ("transformer.layers.0.attention.query_key_value.weight", "mixins.patch_embed.proj.weight"),
    layout_spelling(_LAYOUT)))
