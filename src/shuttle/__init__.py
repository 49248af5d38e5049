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
    UnmergeReport,
    apply_lora,
    attach_lora,
    extract_lora,
    load_checkpoint,
    lora_scale,
    merge_lora,
    replacement_parameters,
    scaled_stream,
    unmerge_lora,
)
from shuttle.apply.merge_files import FileMergeReport, merge_files
from shuttle.cache import (
    LoRASpec,
    LRUEvictionPolicy,
    ModelCache,
    ModelSpec,
    ObjectSpec,
    ResourceCache,
)
from shuttle.formats import FORMATS, LoRA, load_lora, register_format, save_lora
from shuttle.offload import ModelOffloader, StreamConfig
from shuttle.patches import PATCH_KINDS, register_patch
from shuttle.targets import Resolution, resolve
from shuttle.version import __version__ as __version__
from shuttle.weights import upcast_on_use

__all__ = [
    "FORMATS",
    "AdapterReport",
    "AutoReport",
    "DynamicAdapters",
    "ExtractReport",
    "FileMergeReport",
    "PATCH_KINDS",
    "LoRA",
    "LoRASpec",
    "LRUEvictionPolicy",
    "LoadReport",
    "MergeReport",
    "ModelCache",
    "ModelOffloader",
    "ModelSpec",
    "ObjectSpec",
    "Resolution",
    "ResourceCache",
    "StreamConfig",
    "UnmergeReport",
    "apply_lora",
    "attach_lora",
    "errors",
    "extract_lora",
    "load_checkpoint",
    "load_lora",
    "lora_scale",
    "merge_files",
    "merge_lora",
    "register_format",
    "register_patch",
    "replacement_parameters",
    "resolve",
    "save_lora",
    "scaled_stream",
    "unmerge_lora",
    "upcast_on_use",
]
