"""LyCORIS: LoHa (``hada_*``), LoKr (``lokr_*``), full (``diff``), norm (``w_norm``) and (IA)3
(``weight`` + ``on_input``), under kohya-style or ``lycoris_`` names.

Also what tells a file written by LyCORIS (:func:`written_by_lycoris`), whose ``dora_scale``
takes a strength as LyCORIS does rather than as ComfyUI does (``shuttle.patches.dora``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from shuttle.formats.registry import register_format

__all__ = ["DORA_RULE_KEY", "written_by_lycoris"]

_MARKERS = (".hada_w1_a", ".lokr_w1", ".lokr_w1_a", ".w_norm", ".on_input")

# The __metadata__ key in which shuttle's writer records a dora_scale's strength rule, so that a
# converted file (whose names and metadata no longer show LyCORIS) reads back the same.
DORA_RULE_KEY = "shuttle_dora"


@register_format(
    "lycoris", priority=30,
    description="LyCORIS: LoHa hada_*, LoKr lokr_*, full diff/diff_b, norm w_norm/b_norm, (IA)3",
)
def detect(keys, config):  # noqa: D103
    if config is not None:
        return False  # PEFT's own LoHa/LoKr save the same spellings; see the peft format
    return any(k.startswith("lycoris_") or any(m in k for m in _MARKERS) for k in keys)


def written_by_lycoris(keys: Collection[str], metadata: Mapping[str, str]) -> bool:
    """Whether an adapter's names or ``__metadata__`` show that LyCORIS wrote it.

    Signs: the ``lycoris_`` module prefix of LyCORIS's own wrapper (``lycoris.wrapper``, used
    by SimpleTuner and others), or ``ss_network_module`` naming a LyCORIS module in the
    metadata sd-scripts writes (``--network_module lycoris.kohya``, whose names are kohya's
    ``lora_unet_``/``lora_te_``). LyCORIS's ``save_weights`` adds no metadata of its own, and
    a LoHa or LoKr alone is no sign: other trainers write those spellings too.
    """
    if str(metadata.get("ss_network_module", "")).startswith("lycoris"):
        return True
    return any(k.startswith("lycoris_") for k in keys)
