"""XLabs Flux LoRAs: ``double_blocks.N.processor.{qkv,proj}_lora{1,2}.{down,up}.weight``.

``lora1`` is the image stream and ``lora2`` the text stream of a BFL double block.
"""

from __future__ import annotations

import re

from shuttle.formats.registry import register_format

_KEY = re.compile(r"^(.*)\.processor\.(qkv|proj)_lora([12])\.(down|up)\.weight$")


def _rename(key: str) -> str:
    m = _KEY.match(key)
    if m is None:
        return key
    block, layer, stream, role = m.groups()
    side = "img" if stream == "1" else "txt"
    return f"{block}.{side}_attn.{layer}.lora_{role}.weight"


@register_format(
    "xlabs", priority=10, rename=_rename,
    description="XLabs Flux: double_blocks.N.processor.{qkv,proj}_lora{1,2}.{down,up}",
)
def detect(keys, config):  # noqa: D103
    return any(_KEY.match(k) for k in keys)
