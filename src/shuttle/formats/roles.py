"""Key spellings: which part of an adapter key names the module and which the tensor's role.

Every tool spells the same roles differently (``lora_up.weight``, ``lora_B.weight``,
``lora_B.default.weight``, ``lora.up.weight``, ``_lora.up.weight``, ...). :func:`split_key` turns
any of them into ``(module_key, role)``; the role names are shuttle's own.
"""

from __future__ import annotations

__all__ = ["ROLE_SUFFIXES", "UNSUPPORTED_SUFFIXES", "split_key"]

# role -> spellings of the key suffix after "<module>." (or "<module>_" where marked by a
# leading "_"). Longest spellings are tried first, so "lora_B.default.weight" wins over "lora_B".
ROLE_SUFFIXES: dict[str, tuple[str, ...]] = {
    "up": ("lora_up.weight", "lora_B.weight", "lora_B.default.weight", "lora_B.default",
           "lora_B", "lora.up.weight", "_lora.up.weight", "lora_linear_layer.up.weight"),
    "down": ("lora_down.weight", "lora_A.weight", "lora_A.default.weight", "lora_A.default",
             "lora_A", "lora.down.weight", "_lora.down.weight", "lora_linear_layer.down.weight"),
    "mid": ("lora_mid.weight",),
    "up_bias": ("lora_B.bias", "lora_B.default.bias", "lora_up.bias"),
    "alpha": ("alpha", "lora_alpha"),
    "magnitude": ("lora_magnitude_vector", "lora_magnitude_vector.weight",
                  "lora_magnitude_vector.default", "lora_magnitude_vector.default.weight"),
    "dora_scale": ("dora_scale",),
    "emb_down": ("lora_embedding_A", "lora_embedding_A.default", "lora_embedding_A.weight"),
    "emb_up": ("lora_embedding_B", "lora_embedding_B.default", "lora_embedding_B.weight"),
    **{f"hada_{n}": (f"hada_{n}", f"hada_{n}.default", f"hada_{n}.weight")
       for n in ("w1_a", "w1_b", "w2_a", "w2_b", "t1", "t2")},
    **{f"lokr_{n}": (f"lokr_{n}", f"lokr_{n}.default", f"lokr_{n}.weight")
       for n in ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b", "t2")},
    "diff": ("diff",),
    "diff_b": ("diff_b",),
    "set_weight": ("set_weight",),
    "w_norm": ("w_norm",),
    "b_norm": ("b_norm",),
    "on_input": ("on_input",),
    # BFL control LoRA: RMSNorm scales replaced whole (ComfyUI turns them into set_weight).
    "norm_scale": ("query_norm.scale", "key_norm.scale"),
}

# Spellings of formats shuttle recognizes but does not implement, with the format's name.
UNSUPPORTED_SUFFIXES: dict[str, str] = {
    "oft_blocks": "OFT/BOFT (LyCORIS)",
    "oft_diag": "OFT (kohya)",
    "rescale": "OFT/BOFT (LyCORIS)",
    "a1.weight": "GLoRA",
    "a2.weight": "GLoRA",
    "b1.weight": "GLoRA",
    "b2.weight": "GLoRA",
    "bm.weight": "GLoRA",
    "oft_r": "OFT (PEFT)",
    "ia3_l": "(IA)3 (PEFT)",
    "reshape_weight": "ComfyUI reshape_weight",
    # T-LoRA's update depends on the timestep (lambda_layer masks ranks per step): no static
    # merge exists.
    "lambda_layer": "T-LoRA (LyCORIS)",
}

_TABLE: list[tuple[str, str]] = sorted(
    ((s, role) for role, spellings in ROLE_SUFFIXES.items() for s in spellings),
    key=lambda sr: -len(sr[0]),
)


def split_key(key: str) -> tuple[str, str] | None:
    """Split an adapter key into ``(module_key, role)``, or None if no spelling matches.

    Examples:
        >>> split_key("lora_unet_down_blocks_0_proj_in.lora_down.weight")
        ('lora_unet_down_blocks_0_proj_in', 'down')
        >>> split_key("transformer.blocks.0.attn.to_q.lora_B.default.weight")
        ('transformer.blocks.0.attn.to_q', 'up')
        >>> split_key("unet.mid_block.attn1.processor.to_q_lora.up.weight")
        ('unet.mid_block.attn1.processor.to_q', 'up')
        >>> split_key("double_blocks.0.img_attn.norm.query_norm.scale")
        ('double_blocks.0.img_attn.norm.query_norm', 'norm_scale')
    """
    for suffix, role in _TABLE:
        if suffix.startswith("_"):
            if key.endswith(suffix) and len(key) > len(suffix):
                return key[: -len(suffix)], role
        elif key.endswith("." + suffix):
            module = key[: -len(suffix) - 1]
            if role == "norm_scale":
                module = key[: -len(".scale")]
            return module, role
    return None


def unsupported_kind(key: str) -> str | None:
    """The name of an unimplemented format that ``key`` belongs to, if any."""
    for suffix, name in UNSUPPORTED_SUFFIXES.items():
        if key.endswith("." + suffix) or key == suffix:
            return name
    return None
