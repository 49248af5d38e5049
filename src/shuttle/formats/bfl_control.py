"""Black Forest Labs control LoRAs (FLUX.1 Depth/Canny): PEFT factors on BFL names, bias deltas
in ``lora_B.bias`` and whole replacements of the attention norms' ``scale``.
"""

from __future__ import annotations

from shuttle.formats.registry import register_format


@register_format(
    "bfl-control", priority=20,
    description="BFL control LoRA: lora_A/lora_B + lora_B.bias + *_norm.scale replacements",
)
def detect(keys, config):  # noqa: D103
    return any(k.endswith(("query_norm.scale", "key_norm.scale")) for k in keys)
