"""shuttle: read every LoRA-style adapter and apply it exactly and fast.

The public API; see docs/ for guides.
"""

from shuttle import errors
from shuttle.apply import (
    AdapterReport,
    AutoReport,
    DynamicAdapters,
    ExtractReport,
    LoadReport,
    MergeReport,
    Note,
    UnmergeReport,
    apply_lora,
    attach_lora,
    clear_memo,
    extract_lora,
    load_checkpoint,
    lora_scale,
    merge_lora,
    scaled_stream,
    unmerge_lora,
)
from shuttle.apply.merge_files import FileMergeReport, merge_files
from shuttle.cache import LoRASpec, ModelCache, ModelSpec
from shuttle.formats import LoRA, load_lora, register_format, save_lora
from shuttle.integrations.handle import OffloadHandle
from shuttle.offload import ModelOffloader, StreamConfig
from shuttle.patches import register_patch
from shuttle.targets import Resolution, resolve
from shuttle.version import __version__ as __version__
from shuttle.weights import upcast_on_use

__all__ = [
    "AdapterReport",
    "AutoReport",
    "DynamicAdapters",
    "ExtractReport",
    "FileMergeReport",
    "LoRA",
    "LoRASpec",
    "LoadReport",
    "MergeReport",
    "ModelCache",
    "ModelOffloader",
    "ModelSpec",
    "Note",
    "OffloadHandle",
    "Resolution",
    "StreamConfig",
    "UnmergeReport",
    "apply_lora",
    "attach_lora",
    "clear_memo",
    "errors",
    "extract_lora",
    "load_checkpoint",
    "load_lora",
    "lora_scale",
    "merge_files",
    "merge_lora",
    "register_format",
    "register_patch",
    "resolve",
    "save_lora",
    "scaled_stream",
    "unmerge_lora",
    "upcast_on_use",
]
