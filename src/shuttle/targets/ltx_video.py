"""LTX-Video names: Lightricks' original layout on diffusers' LTXVideoTransformer3DModel.

The original code (``ltx_video/models/transformers/transformer3d.py``: ``Transformer3DModel``)
is diffusers-like already: ``transformer_blocks.N.attn1.to_q``, ``attn2.to_out.0``,
``ff.net.0.proj``, ``scale_shift_table``, ``caption_projection.linear_1``, ``proj_out`` are the
same in both. Four names differ, as ``convert_ltx_transformer_checkpoint_to_diffusers``
(loaders/single_file_utils.py) renames them: ``patchify_proj`` is ``proj_in``,
``adaln_single`` (``.emb.timestep_embedder.linear_1``, ``.linear``) is ``time_embed``, and the
attention's RMSNorms ``q_norm``/``k_norm`` are ``norm_q``/``norm_k``. Adapters come as
``diffusion_model.`` keys (ComfyUI, LTX-Video-Trainer's ComfyUI export) with either spelling of
those layers; diffusers' ``_convert_non_diffusers_ltxv_lora_to_diffusers``
(loaders/lora_conversion_utils.py) only strips the prefix, so it leaves the four original names
on layers its model lacks. Every layer keeps its shape.
"""

from __future__ import annotations

from shuttle.targets.family import register_family
from shuttle.targets.family_table import Table, family_table, renamed, reverse_table
from shuttle.targets.names import ModelNames

__all__ = ["ltx_video_names", "ltx_video_original_names"]

# diffusers -> original, for the leading component of a path.
_HEAD = {"proj_in": "patchify_proj", "time_embed": "adaln_single"}
# diffusers -> original, for the last component (the attention's RMSNorms).
_LEAF = {"norm_q": "q_norm", "norm_k": "k_norm"}


def _root(names: ModelNames) -> str | None:
    for root in names.roots:
        if (f"{root}proj_in.weight" in names.shapes
                and f"{root}time_embed.emb.timestep_embedder.linear_1.weight" in names.shapes
                and f"{root}transformer_blocks.0.attn1.to_q.weight" in names.shapes
                and f"{root}transformer_blocks.0.scale_shift_table" in names.shapes
                and f"{root}audio_proj_in.weight" not in names.shapes):  # LTX-2 renames more
            return root
    return None


def _original(rel: str) -> str:
    head, dot, rest = rel.partition(".")
    parts = [_HEAD.get(head, head)] + (rest.split(".") if dot else [])
    if len(parts) > 1:
        parts[-1] = _LEAF.get(parts[-1], parts[-1])
    return ".".join(parts)


@register_family
@family_table
def ltx_video_names(names: ModelNames) -> Table | None:
    """Original module path -> diffusers path, for a diffusers LTX-Video model (or None).

    Every module is listed, renamed or not; the bare ``scale_shift_table`` parameters map to
    themselves.
    """
    root = _root(names)
    if root is None:
        return None
    table = {}
    for param in names.shapes:
        if not param.startswith(root):
            continue
        rel = param[len(root):]
        module, _, leaf = rel.rpartition(".")
        if leaf == "scale_shift_table":  # a bare (n, dim) parameter: its own module
            table[rel] = param
        elif module:
            table[_original(module)] = root + module
    return table


_DIFFUSERS_HEAD = {o: d for d, o in _HEAD.items()}
_DIFFUSERS_LEAF = {o: d for d, o in _LEAF.items()}


def _diffusers(param: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """An original parameter name in diffusers' spelling (the renames above, turned around)."""
    parts = param.split(".")
    parts[0] = _DIFFUSERS_HEAD.get(parts[0], parts[0])
    if len(parts) > 2:  # module.leaf: the module's last component
        parts[-2] = _DIFFUSERS_LEAF.get(parts[-2], parts[-2])
    return [(".".join(parts), shape)]


def _as_diffusers(names: ModelNames) -> tuple[str, ModelNames] | None:
    for root in names.roots:
        if (f"{root}patchify_proj.weight" in names.shapes
                and f"{root}adaln_single.emb.timestep_embedder.linear_1.weight" in names.shapes
                and f"{root}transformer_blocks.0.attn1.to_q.weight" in names.shapes):
            return root, renamed(names, root, _diffusers)
    return None


ltx_video_original_names = register_family(family_table(reverse_table(
    ltx_video_names.__wrapped__, _as_diffusers)))
