"""Reading and writing adapter files: format detection, key spellings, lazy safetensors access."""

# Each format module registers itself on import.
from shuttle.formats import bfl_control, comfy, diffusers, kohya, lycoris, peft, xlabs  # noqa: F401
from shuttle.formats.lora import LoRA, load_lora
from shuttle.formats.peft import PeftConfig
from shuttle.formats.registry import FORMATS, AdapterFormat, detect_format, register_format
from shuttle.formats.safetensors_file import LazyTensor, SafetensorsFile
from shuttle.formats.writer import save_lora

__all__ = [
    "FORMATS",
    "AdapterFormat",
    "LazyTensor",
    "LoRA",
    "PeftConfig",
    "SafetensorsFile",
    "detect_format",
    "load_lora",
    "register_format",
    "save_lora",
]
