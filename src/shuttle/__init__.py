"""shuttle: read every LoRA-style adapter and apply it exactly and fast.

The public API; see docs/ for guides.
"""

from shuttle import errors
from shuttle.apply import (
    DynamicAdapters,
    MergeReport,
    apply_lora,
    attach_lora,
    lora_scale,
    merge_lora,
)
from shuttle.formats import FORMATS, LoRA, load_lora, register_format, save_lora
from shuttle.patches import PATCH_KINDS, register_patch
from shuttle.targets import Resolution, resolve

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "DynamicAdapters",
    "PATCH_KINDS",
    "LoRA",
    "MergeReport",
    "Resolution",
    "apply_lora",
    "attach_lora",
    "errors",
    "load_lora",
    "lora_scale",
    "merge_lora",
    "register_format",
    "register_patch",
    "resolve",
    "save_lora",
]
