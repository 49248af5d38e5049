"""LyCORIS: LoHa (``hada_*``), LoKr (``lokr_*``), full (``diff``), norm (``w_norm``) and (IA)3
(``weight`` + ``on_input``), under kohya-style or ``lycoris_`` names.
"""

from __future__ import annotations

from shuttle.formats.registry import register_format

_MARKERS = (".hada_w1_a", ".lokr_w1", ".lokr_w1_a", ".w_norm", ".on_input")


@register_format(
    "lycoris", priority=30,
    description="LyCORIS: LoHa hada_*, LoKr lokr_*, full diff/diff_b, norm w_norm/b_norm, (IA)3",
)
def detect(keys, config):  # noqa: D103
    if config is not None:
        return False  # PEFT's own LoHa/LoKr save the same spellings; see the peft format
    return any(k.startswith("lycoris_") or any(m in k for m in _MARKERS) for k in keys)
