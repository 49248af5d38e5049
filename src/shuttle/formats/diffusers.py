"""diffusers: the legacy attention-processor spellings (``lora.up``, ``_lora.up``,
``lora_linear_layer.up``) and the current PEFT-style ``lora_A``/``lora_B`` on pipeline
component names (``transformer.``, ``unet.``, ``text_encoder.``), with the PEFT configs that
diffusers keeps in the safetensors header.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from shuttle.errors import CorruptFileError
from shuttle.formats.json_text import load_json
from shuttle.formats.registry import register_format

__all__ = ["METADATA_KEY", "configs_from_metadata"]

METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
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


def configs_from_metadata(
    metadata: Mapping[str, str], where: str
) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """The PEFT configs diffusers stores as JSON under ``__metadata__["lora_adapter_metadata"]``.

    diffusers writes two layouts of that one JSON object:

    * a model's ``save_lora_adapter``: its ``LoraConfig.to_dict()`` as is (flat: ``"r"``,
      ``"lora_alpha"``, ``"rank_pattern"``, ...), for keys without a component prefix;
    * a pipeline's ``save_lora_weights(..., transformer_lora_adapter_metadata=cfg)``: each
      component's dict with every field prefixed by the component's name (``"transformer.r"``,
      ``"text_encoder_2.lora_alpha"``; ``_pack_dict_with_prefix``), for the tensors under
      ``<component>.``. Loading keeps, per component, the fields under ``<component>.`` and
      builds that component's ``LoraConfig`` from them alone.

    PEFT config fields never contain a dot, so the first dot of a field name ends its component.

    Args:
        metadata: a safetensors ``__metadata__``.
        where: how to name the file in messages.

    Returns:
        ``(flat, components)``: the flat config (None when there is none), and component name
        -> that component's config.

    Raises:
        CorruptFileError: the entry is not a JSON object (diffusers cannot load the file either).
    """
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return None, {}
    try:
        cfg = load_json(raw)
        problem = None if isinstance(cfg, dict) else f"it holds a {type(cfg).__name__}"
    except ValueError as e:  # not JSON, or nested too deep
        problem = f"invalid JSON: {e}"
    if problem is not None:
        raise CorruptFileError(
            f"{where}: the {METADATA_KEY!r} metadata entry is not a JSON object ({problem}), so "
            "the adapter's scales cannot be read. Save the adapter again, or write the file "
            "without that entry and pass its PEFT config as load_lora(config=...)."
        )
    flat: dict[str, Any] = {}
    components: dict[str, dict[str, Any]] = defaultdict(dict)
    for key, value in cfg.items():
        component, dot, field = key.partition(".")
        if dot:
            components[component][field] = value
        else:
            flat[key] = value
    return (flat or None), dict(components)
