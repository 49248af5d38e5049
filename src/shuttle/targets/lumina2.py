"""Lumina-Image 2.0 and Z-Image names: the NextDiT layout on diffusers' Lumina2 and Z-Image models.

Both come from Alpha-VLLM's NextDiT (Lumina-Image-2.0 ``models/model.py``; ComfyUI's
``comfy/ldm/lumina/model.py`` runs both families): blocks in ``noise_refiner.N``,
``context_refiner.N`` and ``layers.N``, each with ``attention.qkv`` (q, k, v stacked by rows),
``attention.out``, ``attention.q_norm``/``k_norm``, ``feed_forward.w1/w2/w3``,
``attention_norm1/2``, ``ffn_norm1/2`` and, outside the context refiner, ``adaLN_modulation``;
then ``x_embedder``, ``t_embedder.mlp.0/2``, ``cap_embedder.0/1`` and ``final_layer``.
Adapters come as ``diffusion_model.`` keys or kohya's ``lora_unet_layers_0_attention_qkv``.

- Lumina2Transformer2DModel renames nearly everything, as ``convert_lumina2_to_diffusers``
  (loaders/single_file_utils.py) and ``_convert_non_diffusers_lumina2_lora_to_diffusers``
  (loaders/lora_conversion_utils.py) do: ``attention`` is ``attn``, ``out`` ``to_out.0``,
  ``w1/w2/w3`` ``linear_1/2/3``, ``attention_norm1`` ``norm1.norm`` (the context refiner's
  plain ``norm1``), ``attention_norm2`` ``norm2``, ``adaLN_modulation.1`` ``norm1.linear``;
  ``t_embedder``/``cap_embedder`` live in ``time_caption_embed``; ``final_layer``'s
  ``adaLN_modulation.1`` and ``linear`` are ``norm_out.linear_1`` and ``linear_2``.
- ZImageTransformer2DModel keeps the NextDiT names but for those
  ``convert_z_image_transformer_checkpoint_to_diffusers`` and
  ``_convert_non_diffusers_z_image_lora_to_diffusers`` rename: ``attention.out`` is
  ``attention.to_out.0``, ``q_norm``/``k_norm`` are ``norm_q``/``norm_k``, and ``x_embedder``
  and ``final_layer`` are the entries of ``all_x_embedder``/``all_final_layer`` (``"2-1"``).

In both, ``attention.qkv`` splits by rows over ``to_q``, ``to_k``, ``to_v``, whose heights (the
query and the grouped key/value heads) come from the model's layers. No (shift, scale) swap:
NextDiT's final adaLN gives a scale only.
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
from shuttle.targets.split import MappingValue

__all__ = ["lumina2_names", "lumina2_original_names", "z_image_names", "z_image_original_names"]

_KINDS = ("noise_refiner", "context_refiner", "layers")  # NextDiT's block lists

# Lumina2: below ``<blocks>.N.`` (original -> diffusers); the context refiner has no adaLN.
_LUMINA_BLOCK = {
    "attention.out": "attn.to_out.0", "attention.q_norm": "attn.norm_q",
    "attention.k_norm": "attn.norm_k", "feed_forward.w1": "feed_forward.linear_1",
    "feed_forward.w2": "feed_forward.linear_2", "feed_forward.w3": "feed_forward.linear_3",
    "attention_norm1": "norm1.norm", "attention_norm2": "norm2",
    "ffn_norm1": "ffn_norm1", "ffn_norm2": "ffn_norm2", "adaLN_modulation.1": "norm1.linear",
}
_LUMINA_CONTEXT = _LUMINA_BLOCK | {"attention_norm1": "norm1"}
_LUMINA_TOP = {
    "x_embedder": "x_embedder",
    "t_embedder.mlp.0": "time_caption_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_caption_embed.timestep_embedder.linear_2",
    "cap_embedder.0": "time_caption_embed.caption_embedder.0",
    "cap_embedder.1": "time_caption_embed.caption_embedder.1",
    "final_layer.adaLN_modulation.1": "norm_out.linear_1",
    "final_layer.linear": "norm_out.linear_2",
}
# Z-Image: below ``<blocks>.N.``, the names that differ; the rest are the same.
_Z_BLOCK = {"attention.out": "attention.to_out.0", "attention.q_norm": "attention.norm_q",
            "attention.k_norm": "attention.norm_k"}
_Z_SAME = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "attention_norm1",
           "attention_norm2", "ffn_norm1", "ffn_norm2", "adaLN_modulation.0")
_Z_TOP = ("t_embedder.mlp.0", "t_embedder.mlp.2", "cap_embedder.0", "cap_embedder.1",
          "x_pad_token", "cap_pad_token")





def _one_patch_size(names: ModelNames, paths: tuple[str, ...]) -> MappingValue | None:
    """The entry ``2-1`` (diffusers' default) of ``all_x_embedder``/``all_final_layer`` as the
    model's one entry, whatever its key (None with several patch sizes: the original names none).
    """
    head, _, rest = paths[0].partition(".2-1")
    keys = {m[len(head) + 1:].split(".")[0] for m in names.modules if m.startswith(head + ".")}
    return f"{head}.{keys.pop()}{rest}" if len(keys) == 1 else None


# Original path template -> diffusers place (qkv: the query and the grouped key/value heads).
_LUMINA_LAYOUT: Layout = (
    {f"{b}.{{i}}.{o}": f"{b}.{{i}}.{d}" for b in _KINDS
     for o, d in (_LUMINA_CONTEXT if b == "context_refiner" else _LUMINA_BLOCK).items()}
    | {f"{b}.{{i}}.attention.qkv": tuple(f"{b}.{{i}}.attn.{d}" for d in ("to_q", "to_k", "to_v"))
       for b in _KINDS}
    | _LUMINA_TOP)
_Z_LAYOUT: Layout = (
    {f"{b}.{{i}}.{o}": f"{b}.{{i}}.{d}" for b in _KINDS for o, d in _Z_BLOCK.items()}
    | {f"{b}.{{i}}.{o}": f"{b}.{{i}}.{o}" for b in _KINDS for o in _Z_SAME}
    | {f"{b}.{{i}}.attention.qkv":
       tuple(f"{b}.{{i}}.attention.{d}" for d in ("to_q", "to_k", "to_v")) for b in _KINDS}
    | {o: o for o in _Z_TOP}
    | {"x_embedder": Placed("all_x_embedder.2-1", _one_patch_size),
       "final_layer.linear": Placed("all_final_layer.2-1.linear", _one_patch_size),
       "final_layer.adaLN_modulation.1":
       Placed("all_final_layer.2-1.adaLN_modulation.1", _one_patch_size)})


@register_family
@family_table
def lumina2_names(names: ModelNames) -> Table | None:
    """NextDiT module path -> diffusers place, for a diffusers Lumina2 model (or None)."""
    root = next((r for r in names.roots
                 if f"{r}time_caption_embed.timestep_embedder.linear_1.weight" in names.shapes
                 and f"{r}layers.0.attn.to_q.weight" in names.shapes
                 and f"{r}norm_out.linear_1.weight" in names.shapes), None)
    return None if root is None else layout_table(names, root, _LUMINA_LAYOUT)


@register_family
@family_table
def z_image_names(names: ModelNames) -> Table | None:
    """NextDiT module path -> diffusers place, for a diffusers Z-Image model (or None).

    With several patch sizes (``all_x_embedder`` entries) the original ``x_embedder`` and
    ``final_layer`` name none of them and stay unplaced.
    """
    root = next((r for r in names.roots
                 if f"{r}layers.0.attention.to_q.weight" in names.shapes
                 and f"{r}t_embedder.mlp.0.weight" in names.shapes
                 and any(m.startswith(f"{r}all_x_embedder.") for m in names.modules)), None)
    return None if root is None else layout_table(names, root, _Z_LAYOUT)


# NextDiT's original checkpoints (Lumina2 and Z-Image alike) hold these, so both reversed tables
# serve such a model; an adapter's diffusers spelling picks one.
_NEXTDIT = ("layers.0.attention.qkv.weight", "t_embedder.mlp.0.weight", "cap_embedder.1.weight")
lumina2_original_names = register_family(respelled_reverse(
    lumina2_names.__wrapped__, _NEXTDIT, layout_spelling(_LUMINA_LAYOUT)))
z_image_original_names = register_family(respelled_reverse(
    z_image_names.__wrapped__, _NEXTDIT, layout_spelling(_Z_LAYOUT)))
