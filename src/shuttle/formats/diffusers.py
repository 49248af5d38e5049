"""diffusers: the legacy attention-processor spellings (``lora.up``, ``_lora.up``,
``lora_linear_layer.up``) and the current PEFT-style ``lora_A``/``lora_B`` on pipeline
component names (``transformer.``, ``unet.``, ``text_encoder.``).
"""

from __future__ import annotations

from shuttle.formats.registry import register_format

_LEGACY = (".lora.up.weight", "_lora.up.weight", ".lora_linear_layer.up.weight")


@register_format(
    "diffusers-legacy", priority=50,
    description="legacy diffusers: lora.up/down, _lora.up/down, lora_linear_layer.up/down",
)
def detect_legacy(keys, config):  # noqa: D103
    return any(k.endswith(_LEGACY) for k in keys)


@register_format(
    "diffusers", priority=90,
    description="diffusers: lora_A/lora_B on pipeline component names (transformer., unet., ...)",
)
def detect(keys, config):  # noqa: D103
    return any(".lora_A." in k or k.endswith(".lora_A") for k in keys)
