"""Fast LoRA training: hand-derived backward passes over frozen plain, 4-bit or float8 bases.

:func:`accelerate` patches a PEFT LoRA model in place (and :func:`restore` undoes it); the
functions it installs are usable on their own: :func:`lora_linear`, :func:`lora_projections`
(q/k/v sharing one input), :func:`lora_mlp` (SwiGLU / GeGLU).
"""

from shuttle.train.frozen import FrozenLinear, frozen_linear
from shuttle.train.lora_linear import lora_linear
from shuttle.train.lora_mlp import lora_mlp
from shuttle.train.lora_qkv import lora_projections
from shuttle.train.peft_patch import AccelerateReport, accelerate, restore

__all__ = [
    "AccelerateReport",
    "FrozenLinear",
    "accelerate",
    "frozen_linear",
    "lora_linear",
    "lora_mlp",
    "lora_projections",
    "restore",
]
