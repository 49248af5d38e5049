"""Real-size LTX-Video, Lumina-Image 2.0 and Z-Image models (on ``meta``) and the layouts of
LoRAs in their original names, written from them as :mod:`tests.targets.family_layouts` writes
the other families'.

Run ``.venv/bin/python -m tests.targets.ltx_lumina_layouts`` to write their files in
``tests/data/family_keys/``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tests.targets.family_layouts import lora_keys, original_layers, write

# Lightricks/LTX-Video-0.9.7-dev (13B), transformer/config.json: 48 layers of 32 heads x 128,
# T5-XXL's 4096-wide context; the rest diffusers' defaults (the 2B models' values).
LTXV_13B = dict(num_layers=48, num_attention_heads=32, attention_head_dim=128,
                cross_attention_dim=4096, caption_channels=4096)
# Alpha-VLLM/Lumina-Image-2.0, transformer/config.json: diffusers' defaults with Gemma 2's
# 2304-wide captions.
LUMINA2 = dict(cap_feat_dim=2304)
# Tongyi-MAI/Z-Image-Turbo, transformer/config.json: diffusers' defaults.


def build(kind: str) -> nn.Module:
    """The diffusers model ``kind`` at real size on the meta device."""
    import diffusers

    with torch.device("meta"):
        if kind == "ltxv_13b":
            return diffusers.LTXVideoTransformer3DModel(**LTXV_13B)
        if kind == "lumina2":
            return diffusers.Lumina2Transformer2DModel(**LUMINA2)
        if kind == "z_image":
            return diffusers.ZImageTransformer2DModel()
    raise KeyError(kind)


def table_of(kind: str) -> Callable:
    """The family's table builder (before lookup) for model ``kind``."""
    from shuttle.targets.ltx_video import ltx_video_names
    from shuttle.targets.lumina2 import lumina2_names, z_image_names

    return {"ltxv_13b": ltx_video_names, "lumina2": lumina2_names,
            "z_image": z_image_names}[kind].__wrapped__


# file -> (model, spelling): every Linear of the model, in its original name.
FILES = {
    "ltxv-13b-diffusion-model.json": ("ltxv_13b", "peft:diffusion_model."),
    "lumina2-diffusion-model.json": ("lumina2", "peft:diffusion_model."),
    "z-image-turbo-kohya.json": ("z_image", "kohya"),
}


def layout(name: str, model: nn.Module | None = None) -> dict[str, list[int]]:
    """The layout of file ``name``, written from the model (built when not given)."""
    kind, style = FILES[name]
    model = build(kind) if model is None else model
    keys = lora_keys(original_layers(model, table_of(kind)), style)
    assert keys, f"{name}: the table placed no layer of the model"
    return keys


def main() -> None:
    write(FILES, layout)


if __name__ == "__main__":
    main()
