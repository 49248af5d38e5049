"""Real-size CogVideoX transformers (on ``meta``) and the layouts of LoRAs in their original
(SAT) names, written from them as :mod:`tests.targets.family_layouts` writes the other families'.

Run ``.venv/bin/python -m tests.targets.cogvideox_layouts`` to write their files in
``tests/data/family_keys/``.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.targets.family_layouts import lora_keys, original_layers, write

# THUDM/CogVideoX-2b, transformer/config.json: diffusers' defaults (30 layers of 30 heads x 64).
COGVIDEOX_2B: dict = {}
# THUDM/CogVideoX-5b, transformer/config.json: 42 layers of 48 heads x 64, rotary positions.
COGVIDEOX_5B = dict(num_layers=42, num_attention_heads=48, use_rotary_positional_embeddings=True)
CONFIGS = {"cogvideox_2b": COGVIDEOX_2B, "cogvideox_5b": COGVIDEOX_5B}


def build(kind: str) -> nn.Module:
    """The diffusers model ``kind`` at real size on the meta device."""
    import diffusers

    with torch.device("meta"):
        return diffusers.CogVideoXTransformer3DModel(**CONFIGS[kind])


def table():
    """The family's table builder (before lookup)."""
    from shuttle.targets.cogvideox import cogvideox_names

    return cogvideox_names.__wrapped__


# file -> (model, spelling): every Linear and the patch Conv2d, in its original name.
FILES = {
    "cogvideox-2b-diffusion-model.json": ("cogvideox_2b", "diffusion_model"),
    "cogvideox-5b-kohya.json": ("cogvideox_5b", "kohya"),
}


def layout(name: str, model: nn.Module | None = None) -> dict[str, list[int]]:
    """The layout of file ``name``, written from the model (built when not given)."""
    kind, style = FILES[name]
    model = build(kind) if model is None else model
    keys = lora_keys(original_layers(model, table()), style)
    assert keys, f"{name}: the table placed no layer of the model"
    return keys


def main() -> None:
    write(FILES, layout)


if __name__ == "__main__":
    main()
