"""Stable Diffusion 1.x/2.x and SDXL UNet names: the original LDM (sgm) layout on diffusers' UNet.

kohya trains SDXL on its own copy of Stability's sgm UNet, so SDXL LoRAs name modules the LDM way
(``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``), and so do adapters that keep a
checkpoint's own keys (ComfyUI's ``diffusion_model.input_blocks.1.1...``, LyCORIS on an LDM
model). diffusers' ``UNet2DConditionModel`` has the same layers under other names. The table is
built forward from the diffusers model's names; index arithmetic and renames follow
``ldm/modules/diffusionmodules/openaimodel.py`` (``UNetModel``: ``input_blocks``,
``middle_block``, ``output_blocks``, ``time_embed``, ``label_emb``, ``out``; ``ResBlock``:
``in_layers``, ``emb_layers``, ``out_layers``, ``skip_connection``; ``Downsample.op``,
``Upsample.conv``) as diffusers converts them: ``convert_ldm_unet_checkpoint`` and
``update_unet_resnet_ldm_to_diffusers`` (loaders/single_file_utils.py) for whole checkpoints,
``_maybe_map_sgm_blocks_to_diffusers`` and ``_convert_unet_lora_key`` (loaders/
lora_conversion_utils.py) for kohya SDXL LoRAs; ComfyUI's ``comfy.utils.unet_to_diffusers`` is
the same map.

The LDM UNet numbers its blocks in one sequence per direction: ``input_blocks.0`` is
``conv_in``, then each level's ResBlocks (each with its SpatialTransformer at index 1 when the
level has attention) and, below the last level, a Downsample; ``middle_block`` is ResBlock,
SpatialTransformer, ResBlock; ``output_blocks`` count each level's ResBlocks, the last one of a
level carrying the Upsample after its transformer (index 2) or after the ResBlock (index 1).
The SpatialTransformer's inner names (``proj_in``, ``transformer_blocks.N.attn1.to_q``,
``ff.net.0.proj``, ...) are diffusers' too.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict

from shuttle.targets.family import register_family
from shuttle.targets.family_table import Table, family_table, renamed, reverse_table
from shuttle.targets.names import ModelNames

__all__ = ["sd_unet_names", "sd_unet_original_names"]

# ResBlock layers: diffusers ResnetBlock2D name -> LDM ResBlock name.
_RESNET = {
    "norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection",
}
# Layers outside the blocks. SDXL's added conditioning (``add_embedding``) and SD 2.x unCLIP's
# class embedding (``class_embedding``) are both LDM's ``label_emb`` MLP; a model has one.
_TOP = {
    "conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2", "class_embedding.linear_1": "label_emb.0.0",
    "class_embedding.linear_2": "label_emb.0.2", "conv_norm_out": "out.0", "conv_out": "out.2",
}
_BLOCK = re.compile(r"(down|up)_blocks\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)"
                    r"\.(\d+)\.(.+)")
_MID = re.compile(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)")


def _root(names: ModelNames) -> str | None:
    for root in names.roots:
        if (f"{root}conv_in.weight" in names.shapes
                and f"{root}down_blocks.0.resnets.0.conv1.weight" in names.shapes):
            return root
    return None


def _ldm_paths(paths: list[str]) -> dict[str, str]:
    """Map each UNet module among ``paths`` (diffusers names) to its LDM module path."""
    resnets: dict[tuple[str, int], set[int]] = defaultdict(set)  # (down|up, level) -> indices
    attention: set[tuple[str, int]] = set()
    sampler: set[tuple[str, int]] = set()
    for p in paths:
        if m := _BLOCK.fullmatch(p):
            side, level, kind, i = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
            if kind == "resnets":
                resnets[(side, level)].add(i)
            elif kind == "attentions":
                attention.add((side, level))
            else:
                sampler.add((side, level))
    # Where each level's ResBlocks start in the LDM sequence, and its sampler's block index.
    start: dict[tuple[str, int], int] = {}
    sampler_at: dict[tuple[str, int], str] = {}
    n = 1  # input_blocks.0 is conv_in
    for level in sorted(lv for side, lv in resnets if side == "down"):
        start[("down", level)] = n
        n += len(resnets[("down", level)])
        if ("down", level) in sampler:
            sampler_at[("down", level)] = f"input_blocks.{n}.0.op"
            n += 1
    n = 0
    for level in sorted(lv for side, lv in resnets if side == "up"):
        start[("up", level)] = n
        n += len(resnets[("up", level)])
        inner = 2 if ("up", level) in attention else 1
        sampler_at[("up", level)] = f"output_blocks.{n - 1}.{inner}.conv"
    out = {}
    for p in paths:
        if p in _TOP:
            out[p] = _TOP[p]
        elif m := _BLOCK.fullmatch(p):
            side, level, kind, i, rest = m.groups()
            key = (side, int(level))
            block = "input_blocks" if side == "down" else "output_blocks"
            if kind == "resnets" and rest in _RESNET and key in start:
                out[p] = f"{block}.{start[key] + int(i)}.0.{_RESNET[rest]}"
            elif kind == "attentions" and key in start:
                out[p] = f"{block}.{start[key] + int(i)}.1.{rest}"
            elif kind in ("downsamplers", "upsamplers") and rest == "conv" and key in sampler_at:
                out[p] = sampler_at[key]
        elif m := _MID.fullmatch(p):
            kind, i, rest = m.group(1), int(m.group(2)), m.group(3)
            if kind == "attentions" and i == 0:
                out[p] = f"middle_block.1.{rest}"
            elif kind == "resnets" and i in (0, 1) and rest in _RESNET:
                out[p] = f"middle_block.{2 * i}.{_RESNET[rest]}"
    return out


@register_family
@family_table
def sd_unet_names(names: ModelNames) -> Table | None:
    """LDM module path -> diffusers module path, for a diffusers UNet among ``names`` (or None)."""
    root = _root(names)
    if root is None:
        return None
    paths = [m[len(root):] for m in names.modules if m.startswith(root)]
    return {ldm: root + p for p, ldm in _ldm_paths(paths).items()}


# LDM -> diffusers, for a model in the LDM layout. SD 2.x unCLIP's class embedding is also
# ``label_emb``; SDXL's ``add_embedding`` is the one such a model is taken to have.
_DIFFUSERS_RESNET = {ldm: d for d, ldm in _RESNET.items()}
_DIFFUSERS_TOP = {ldm: d for d, ldm in _TOP.items() if not d.startswith("class_embedding")}
_LDM_BLOCK = re.compile(r"(input|output)_blocks\.(\d+)\.(\d+)\.(.+)")
_LDM_MID = re.compile(r"middle_block\.(\d+)\.(.+)")


def _diffusers_paths(modules: set[str]) -> dict[str, str]:
    """Each LDM UNet module path among ``modules`` -> its diffusers path: the block sequence
    read level by level (a Downsample's ``op`` or an Upsample's ``conv`` ends a level).
    """
    where: dict[tuple[str, int], tuple[int, int]] = {}  # (input|output, N) -> (level, index)
    ends: dict[tuple[str, int], int] = {}  # the block holding a level's sampler -> level
    for side in ("input", "output"):
        numbers = sorted({int(m.group(2)) for p in modules
                          if (m := _LDM_BLOCK.fullmatch(p)) and m.group(1) == side})
        level = index = 0
        for n in numbers:
            if side == "input" and n == 0:  # conv_in
                continue
            if side == "input" and f"input_blocks.{n}.0.op" in modules:
                ends[(side, n)] = level
                level, index = level + 1, 0
                continue
            where[(side, n)] = (level, index)
            index += 1
            if side == "output" and (f"output_blocks.{n}.1.conv" in modules
                                     or f"output_blocks.{n}.2.conv" in modules):
                ends[(side, n)] = level
                level, index = level + 1, 0
    out = {}
    for p in modules:
        if p in _DIFFUSERS_TOP:
            out[p] = _DIFFUSERS_TOP[p]
        elif m := _LDM_BLOCK.fullmatch(p):
            side, n, part, rest = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
            block = "down_blocks" if side == "input" else "up_blocks"
            sampler = "downsamplers" if side == "input" else "upsamplers"
            if (side, n) in ends and rest in ("op", "conv") and (part > 0 or side == "input"):
                out[p] = f"{block}.{ends[(side, n)]}.{sampler}.0.conv"
            elif (side, n) in where and part == 0 and rest in _DIFFUSERS_RESNET:
                level, i = where[(side, n)]
                out[p] = f"{block}.{level}.resnets.{i}.{_DIFFUSERS_RESNET[rest]}"
            elif (side, n) in where and part == 1 and rest != "conv":
                level, i = where[(side, n)]
                out[p] = f"{block}.{level}.attentions.{i}.{rest}"
        elif m := _LDM_MID.fullmatch(p):
            part, rest = int(m.group(1)), m.group(2)
            if part == 1:
                out[p] = f"mid_block.attentions.0.{rest}"
            elif part in (0, 2) and rest in _DIFFUSERS_RESNET:
                out[p] = f"mid_block.resnets.{part // 2}.{_DIFFUSERS_RESNET[rest]}"
    return out


def _as_diffusers(names: ModelNames) -> tuple[str, ModelNames] | None:
    for root in names.roots:
        if (f"{root}input_blocks.0.0.weight" in names.shapes
                and f"{root}middle_block.0.in_layers.0.weight" in names.shapes
                and f"{root}out.2.weight" in names.shapes):
            modules = {m[len(root):] for m in names.modules if m.startswith(root)}
            return root, renamed(names, root, functools.partial(_rename,
                                                                _diffusers_paths(modules)))
    return None


def _rename(paths: dict[str, str], param: str,
            shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    module, _, leaf = param.rpartition(".")
    return [(f"{paths[module]}.{leaf}", shape)] if module in paths else []


sd_unet_original_names = register_family(family_table(reverse_table(sd_unet_names.__wrapped__,
                                                                     _as_diffusers)))
