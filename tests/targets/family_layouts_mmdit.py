"""Real-size key layouts of MMDiT families (SD3/3.5, Chroma, FLUX.1 Kontext/Krea, Qwen-Image).

As :mod:`tests.targets.family_layouts` (whose ``lora_keys`` and ``original_layers`` these reuse):
each file is what a trainer on the original code writes, named forward from the diffusers model
built at real size on ``meta`` through the family's table. FLUX.1 variants are named from BFL's
own module tree (:mod:`tests.targets.flux_bfl`), Qwen-Image from the diffusers model itself (its
original code is diffusers'). Tests check every file against diffusers' own converters.

Run ``.venv/bin/python -m tests.targets.family_layouts_mmdit`` to write the files.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tests.targets.family_layouts import lora_keys, original_layers, write

# stabilityai/stable-diffusion-3-medium-diffusers, transformer/config.json
SD3_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24,
                  attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                  caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
                  pos_embed_max_size=192)
# stabilityai/stable-diffusion-3.5-large: 38 blocks of 38 heads, RMS qk norms
SD35_LARGE = SD3_MEDIUM | dict(num_layers=38, num_attention_heads=38,
                               caption_projection_dim=2432, qk_norm="rms_norm")
# stabilityai/stable-diffusion-3.5-medium: MMDiT-X, a second self-attention in blocks 0-12
SD35_MEDIUM = SD3_MEDIUM | dict(qk_norm="rms_norm", pos_embed_max_size=384,
                                dual_attention_layers=tuple(range(13)))
# lodestones/Chroma1-HD, transformer/config.json: diffusers' defaults (19 + 38 blocks, 3072)
# Qwen/Qwen-Image, transformer/config.json: diffusers' defaults (60 blocks, 3072)


def build(kind: str) -> nn.Module:
    """The model ``kind`` at real size on the meta device."""
    import diffusers

    from tests.targets.flux_bfl import FluxBFL

    with torch.device("meta"):
        if kind == "sd3_medium":
            return diffusers.SD3Transformer2DModel(**SD3_MEDIUM)
        if kind == "sd35_large":
            return diffusers.SD3Transformer2DModel(**SD35_LARGE)
        if kind == "sd35_medium":
            return diffusers.SD3Transformer2DModel(**SD35_MEDIUM)
        if kind == "chroma":
            return diffusers.ChromaTransformer2DModel()
        if kind == "flux":  # FLUX.1-dev, -Kontext-dev and -Krea-dev share this config
            return diffusers.FluxTransformer2DModel(guidance_embeds=True)
        if kind == "flux_bfl":
            return FluxBFL()
        if kind == "qwen_image":
            return diffusers.QwenImageTransformer2DModel()
    raise KeyError(kind)


def _own_layers(model: nn.Module) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """Every Linear/conv of ``model`` under its own name (the model is in original names)."""
    return {n: (m.weight.shape[1], m.weight.shape[0], tuple(m.weight.shape[2:]))
            for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)}


def table_of(kind: str) -> Callable[[nn.Module], dict]:
    """Original layer -> (in, out, kernel) of model ``kind``, in its module order."""
    from shuttle.targets.chroma import chroma_names
    from shuttle.targets.sd3 import sd3_names

    if kind in ("flux_bfl", "qwen_image"):
        return _own_layers
    family = {"sd3_medium": sd3_names, "sd35_large": sd3_names, "sd35_medium": sd3_names,
              "chroma": chroma_names}[kind]
    return lambda model: original_layers(model, family.__wrapped__)


def _joint_blocks(path: str) -> bool:
    return path.startswith("joint_blocks.")


def _blocks(path: str) -> bool:
    return path.startswith(("double_blocks.", "single_blocks.", "transformer_blocks."))


def _fal_kontext(path: str) -> bool:
    """fal's Kontext trainer: the blocks' Linears and ``final_layer.linear``."""
    return _blocks(path) or path == "final_layer.linear"


# file -> (model, spelling, which original layers)
FILES: dict[str, tuple[str, str, Callable[[str], bool] | None]] = {
    "sd3-medium-kohya.json": ("sd3_medium", "kohya", _joint_blocks),
    "sd35-large-kohya.json": ("sd35_large", "kohya", _joint_blocks),
    "sd35-medium-all-layers.json": ("sd35_medium", "diffusion_model", None),
    "chroma-kohya.json": ("chroma", "kohya", _blocks),
    "chroma-all-layers.json": ("chroma", "peft:diffusion_model.", None),
    "flux-kontext-kohya.json": ("flux_bfl", "kohya", None),
    "flux-kontext-fal.json": ("flux_bfl", "peft:base_model.model.", _fal_kontext),
    "qwen-image-musubi.json": ("qwen_image", "kohya", _blocks),
    "qwen-image-diffusion-model.json": ("qwen_image", "peft:diffusion_model.", None),
}


def layout(name: str, model: nn.Module | None = None) -> dict[str, list[int]]:
    """The layout of file ``name``, written from the model (built when not given)."""
    kind, style, keep = FILES[name]
    model = build(kind) if model is None else model
    keys = lora_keys(table_of(kind)(model), style, keep or (lambda p: True))
    assert keys, f"{name}: the table placed no layer of the model"
    return keys


def main() -> None:
    write(FILES, layout)


if __name__ == "__main__":
    main()
