"""kohya sd-scripts / A1111: ``lora_unet_*``, ``lora_te[123]_*``, ``lora_transformer_*`` module
names (model paths with ``.`` turned into ``_``) with ``lora_down``/``lora_up``/``alpha``, LoCon
convs, Tucker ``lora_mid``, ``dora_scale``, and the Flux split-qkv save.
"""

from __future__ import annotations

from shuttle.formats.registry import register_format

KOHYA_PREFIXES = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", "lora_te3_",
                  "lora_transformer_", "lycoris_")


@register_format(
    "kohya", priority=40,
    description="kohya / A1111: lora_unet_*/lora_te*_* with lora_down/lora_up/alpha",
    split_qkv_saves=True,
)
def detect(keys, config):  # noqa: D103
    return any(".lora_down." in k or k.startswith(KOHYA_PREFIXES) for k in keys)
