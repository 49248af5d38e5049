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

import re

from shuttle.targets.family import register_family, register_widenable
from shuttle.targets.names import ModelNames
from shuttle.targets.split import MappingValue, Split

__all__ = ["flux_names", "flux_widenable"]

_S = r"[._]"  # adapters spell the same path with dots or with kohya's underscores
# LyCORIS's own wrapper names modules ``lycoris_<path>`` (kohya's underscores, no ``unet``).
_STRIP = ("lora_unet_", "lora_transformer_", "lycoris_", "base_model.model.", "diffusion_model.",
          "transformer.")

# One-to-one layers: BFL path template -> diffusers path template ({i}: block index).
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
# RMSNorms of q and k: BFL path template -> diffusers path template; BFL's parameter is
# ``scale`` where diffusers' is ``weight``.
_DOUBLE_NORMS = {
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
}
_SINGLE_NORMS = {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}
_TO_DIFFUSERS = (("scale", "weight"),)
_TO_BFL = (("weight", "scale"),)
_QKV = {"img": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "txt": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE_SPLIT = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
_FINAL_MOD = ("final_layer.adaLN_modulation.1", "norm_out.linear")


def _pattern(path: str) -> str:
    return _S.join(re.escape(p) for p in path.split("."))


def _layout(names: ModelNames) -> tuple[str, str, int, int] | None:
    """(layout, root, hidden, mlp) of a Flux transformer among the model's names, or None."""
    for root in names.roots:
        qkv = names.shapes.get(f"{root}double_blocks.0.img_attn.qkv.weight")
        lin1 = names.shapes.get(f"{root}single_blocks.0.linear1.weight")
        if qkv is not None and lin1 is not None:
            h = qkv[0] // 3
            return "bfl", root, h, lin1[0] - 3 * h
        q = names.shapes.get(f"{root}transformer_blocks.0.attn.to_q.weight")
        mlp = names.shapes.get(f"{root}single_transformer_blocks.0.proj_mlp.weight")
        if q is not None and mlp is not None:
            return "diffusers", root, q[0], mlp[0]
    return None


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _STRIP:
            if key.startswith(p):
                key, changed = key[len(p):], True
    return key


def _bfl_to_diffusers(key: str, root: str, h: int, m: int) -> MappingValue | None:
    if mt := re.fullmatch(rf"double_blocks{_S}(\d+){_S}(img|txt)_attn{_S}qkv", key):
        i, side = mt.groups()
        return [Split(f"{root}transformer_blocks.{i}.{d}", (k * h, (k + 1) * h))
                for k, d in enumerate(_QKV[side])]
    if mt := re.fullmatch(rf"single_blocks{_S}(\d+){_S}linear1", key):
        bounds = [0, h, 2 * h, 3 * h, 3 * h + m]
        return [Split(f"{root}single_transformer_blocks.{mt.group(1)}.{d}",
                      (bounds[k], bounds[k + 1])) for k, d in enumerate(_SINGLE_SPLIT)]
    if re.fullmatch(_pattern(_FINAL_MOD[0]), key):  # (shift, scale) -> (scale, shift)
        return [Split(f"{root}{_FINAL_MOD[1]}", (0, h), (h, 2 * h)),
                Split(f"{root}{_FINAL_MOD[1]}", (h, 2 * h), (0, h))]
    for bfl, dif in _DOUBLE.items():
        if mt := re.fullmatch(rf"double_blocks{_S}(\d+){_S}{_pattern(bfl)}", key):
            return f"{root}transformer_blocks.{mt.group(1)}.{dif}"
    for bfl, dif in _SINGLE.items():
        if mt := re.fullmatch(rf"single_blocks{_S}(\d+){_S}{_pattern(bfl)}", key):
            return f"{root}single_transformer_blocks.{mt.group(1)}.{dif}"
    for blocks, table, into in (("double_blocks", _DOUBLE_NORMS, "transformer_blocks"),
                                ("single_blocks", _SINGLE_NORMS, "single_transformer_blocks")):
        for bfl, dif in table.items():
            if mt := re.fullmatch(rf"{blocks}{_S}(\d+){_S}{_pattern(bfl)}", key):
                return [Split(f"{root}{into}.{mt.group(1)}.{dif}", params=_TO_DIFFUSERS)]
    for bfl, dif in _TOP.items():
        if re.fullmatch(_pattern(bfl), key):
            return f"{root}{dif}"
    return None


def _diffusers_to_bfl(key: str, root: str, h: int, m: int) -> MappingValue | None:
    if mt := re.fullmatch(rf"transformer_blocks{_S}(\d+){_S}(.+)", key):
        i, rest = mt.groups()
        for side, layers in _QKV.items():
            for k, d in enumerate(layers):
                if re.fullmatch(_pattern(d), rest):
                    return f"{root}double_blocks.{i}.{side}_attn.qkv", (k * h, (k + 1) * h)
        for bfl, dif in _DOUBLE.items():
            if re.fullmatch(_pattern(dif), rest):
                return f"{root}double_blocks.{i}.{bfl}"
        for bfl, dif in _DOUBLE_NORMS.items():
            if re.fullmatch(_pattern(dif), rest):
                return [Split(f"{root}double_blocks.{i}.{bfl}", params=_TO_BFL)]
        return None
    if mt := re.fullmatch(rf"single_transformer_blocks{_S}(\d+){_S}(.+)", key):
        i, rest = mt.groups()
        bounds = [0, h, 2 * h, 3 * h, 3 * h + m]
        for k, d in enumerate(_SINGLE_SPLIT):
            if re.fullmatch(_pattern(d), rest):
                return f"{root}single_blocks.{i}.linear1", (bounds[k], bounds[k + 1])
        for bfl, dif in _SINGLE.items():
            if re.fullmatch(_pattern(dif), rest):
                return f"{root}single_blocks.{i}.{bfl}"
        for bfl, dif in _SINGLE_NORMS.items():
            if re.fullmatch(_pattern(dif), rest):
                return [Split(f"{root}single_blocks.{i}.{bfl}", params=_TO_BFL)]
        return None
    if re.fullmatch(_pattern(_FINAL_MOD[1]), key):  # (scale, shift) -> (shift, scale)
        return [Split(f"{root}{_FINAL_MOD[0]}", (0, h), (h, 2 * h)),
                Split(f"{root}{_FINAL_MOD[0]}", (h, 2 * h), (0, h))]
    for bfl, dif in _TOP.items():
        if re.fullmatch(_pattern(dif), key):
            return f"{root}{bfl}"
    return None


@register_family
def flux_names(module: str, names: ModelNames) -> MappingValue | None:
    """Place a Flux adapter module of one layout on a Flux model of the other, or None."""
    layout = _layout(names)
    if layout is None:
        return None
    kind, root, h, m = layout
    key = _strip(module)
    if kind == "diffusers":
        return _bfl_to_diffusers(key, root, h, m)
    return _diffusers_to_bfl(key, root, h, m)


@register_widenable
def flux_widenable(names: ModelNames) -> dict[str, str | None]:
    """The input embedder (``x_embedder`` / ``img_in``), which a control LoRA (Canny, Depth)
    widens from 64 to 128 input channels: the control image's latents beside the noisy ones.
    diffusers' transformer records that width as ``config.in_channels`` (``FluxControlPipeline``
    reads it to size its latents), as diffusers' own loader sets it.
    """
    layout = _layout(names)
    if layout is None:
        return {}
    kind, root, _, _ = layout
    if kind == "diffusers":
        return {f"{root}x_embedder.weight": "in_channels"}
    return {f"{root}img_in.weight": None}
