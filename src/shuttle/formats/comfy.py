"""ComfyUI dense payloads: ``<module>.diff``, ``<module>.diff_b``, ``<module>.set_weight``,
alone or beside LoRA factors on ``diffusion_model.`` names.
"""

from __future__ import annotations

from shuttle.formats.registry import register_format


@register_format(
    "comfy", priority=80,
    description="ComfyUI: <module>.diff / .diff_b / .set_weight dense payloads (+ LoRA factors)",
)
def detect(keys, config):  # noqa: D103
    return any(k.endswith((".diff", ".diff_b", ".set_weight")) for k in keys)
