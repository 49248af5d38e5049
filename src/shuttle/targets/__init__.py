"""Resolving adapter keys onto a model's parameter names, and the report of what did not match."""

# Model families register their name tables on import.
from shuttle.targets import (  # noqa: F401
    chroma,
    cogvideox,
    flux,
    hunyuan_video,
    ltx_video,
    lumina2,
    sd3,
    sd_unet,
    wan,
)
from shuttle.targets.family import FAMILY_MAPS, register_family
from shuttle.targets.fused import FUSED_GROUPS
from shuttle.targets.names import ADAPTER_PREFIXES, ModelNames, fused_modules, transposed_modules
from shuttle.targets.resolve import KeyMapping, Resolution, Target, resolve
from shuttle.targets.split import Split

__all__ = [
    "ADAPTER_PREFIXES",
    "FAMILY_MAPS",
    "FUSED_GROUPS",
    "KeyMapping",
    "ModelNames",
    "Resolution",
    "Split",
    "Target",
    "fused_modules",
    "transposed_modules",
    "register_family",
    "resolve",
]
