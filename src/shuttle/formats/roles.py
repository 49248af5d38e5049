"""Key spellings: which part of an adapter key names the module and which the tensor's role.

Every tool spells the same roles differently (``lora_up.weight``, ``lora_B.weight``,
``lora_B.default.weight``, ``lora.up.weight``, ``_lora.up.weight``, ...). :func:`split_key` turns
any of them into ``(module_key, role)``; the role names are shuttle's own, declared by each
patch kind (:class:`~shuttle.patches.PatchKind` ``roles``).
"""

from __future__ import annotations

from shuttle.patches import PATCH_KINDS

__all__ = ["UNSUPPORTED_SUFFIXES", "role_suffixes", "split_key"]

# Roles every scaled kind reads, owned by none of them; each kind's own roles (and their
# spellings) are its PatchKind's ``roles`` (shuttle.patches.PATCH_KINDS).
SHARED_ROLES: dict[str, tuple[str, ...]] = {"alpha": ("alpha", "lora_alpha")}


def role_suffixes() -> dict[str, tuple[str, ...]]:
    """Role -> spellings of the key suffix after ``"<module>."`` (or ``"<module>_"`` where
    marked by a leading ``"_"``): the shared roles and those of every registered patch kind.
    """
    out = dict(SHARED_ROLES)
    for kind in PATCH_KINDS.values():
        for role, spellings in kind.roles.items():
            assert role not in out, f"role {role!r} of patch kind {kind.name!r} taken twice"
            out[role] = spellings
    return out


# Spellings of formats shuttle recognizes but does not implement, with the format's name.
UNSUPPORTED_SUFFIXES: dict[str, str] = {
    "oft_diag": "OFT (kohya)",
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

_tables: dict[tuple[str, ...], list[tuple[str, str]]] = {}


def _table() -> list[tuple[str, str]]:
    """``(suffix, role)`` for the kinds registered now, longest suffix first (so
    ``lora_B.default.weight`` wins over ``lora_B``); kept per set of registered kinds.
    """
    kinds = tuple(PATCH_KINDS)
    table = _tables.get(kinds)
    if table is None:
        table = _tables[kinds] = sorted(
            ((s, role) for role, spellings in role_suffixes().items() for s in spellings),
            key=lambda sr: -len(sr[0]),
        )
    return table


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
    for suffix, role in _table():
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
