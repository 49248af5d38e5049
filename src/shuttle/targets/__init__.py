"""Resolving adapter keys onto a model's parameter names, and the report of what did not match."""

from shuttle.targets.fused import FUSED_GROUPS
from shuttle.targets.names import ADAPTER_PREFIXES, ModelNames
from shuttle.targets.resolve import KeyMapping, Resolution, Target, resolve

__all__ = [
    "ADAPTER_PREFIXES",
    "FUSED_GROUPS",
    "KeyMapping",
    "ModelNames",
    "Resolution",
    "Target",
    "resolve",
]
