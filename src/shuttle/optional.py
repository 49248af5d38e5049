"""Optional dependencies, imported where they are used.

shuttle's core needs torch, safetensors and tqdm only; bitsandbytes, torchao, optimum-quanto,
diffusers, transformers and Triton are imported the first time a feature needs them, and a
missing one raises :class:`~shuttle.errors.MissingDependencyError` naming what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from shuttle.errors import MissingDependencyError

__all__ = ["import_optional"]


def import_optional(module: str, needed_by: str, install: str) -> ModuleType:
    """``import module``, or raise an error saying what needs it and how to install it.

    Args:
        module: the dotted module name (``"torchao.quantization"``).
        needed_by: what needs it, for the message (``"torchao weights"``).
        install: the command that installs it (``"pip install shuttle[torchao]"``).

    Raises:
        MissingDependencyError: ``module`` cannot be imported.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = module.split(".")[0]
        raise MissingDependencyError(
            f"{package} is not installed; it is needed for {needed_by}: {install}") from e
