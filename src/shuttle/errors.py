"""Typed errors. Every user mistake raises a subclass of :class:`ShuttleError`.

Each message names what is wrong (the file, key or parameter) and what to do about it. When one
of these is raised by a mutating call, nothing was changed.
"""

from __future__ import annotations

__all__ = [
    "AdapterFileError",
    "AdapterFormatError",
    "CheckpointError",
    "CorruptFileError",
    "DuplicateTargetError",
    "InvalidStrengthError",
    "MissingDependencyError",
    "MissingParameterError",
    "NonFiniteAdapterError",
    "ShapeMismatchError",
    "ShuttleError",
    "UnknownKeyError",
    "UnsupportedFormatError",
    "UnsupportedLayerError",
]


class ShuttleError(Exception):
    """Base class of every error shuttle raises for a user mistake or bad input."""


class AdapterFileError(ShuttleError, OSError):
    """An adapter source cannot be opened (missing file, unknown extension, empty directory)."""


class CorruptFileError(AdapterFileError):
    """A file is truncated or its header lies about its contents."""


class AdapterFormatError(ShuttleError, ValueError):
    """An adapter's keys are malformed (a factor without its partner, a bad alpha, ...)."""


class UnknownKeyError(AdapterFormatError):
    """An adapter holds keys of a kind shuttle does not recognize."""


class UnsupportedFormatError(AdapterFormatError):
    """An adapter uses a known format that shuttle does not implement (OFT, GLoRA, ...)."""


class CheckpointError(ShuttleError, ValueError):
    """Two checkpoints cannot be turned into an adapter as asked (a parameter only in the base
    with ``strict``, a changed integer tensor, no parameter that differs, names that collide).
    """


class ShapeMismatchError(ShuttleError, ValueError):
    """An adapter's update does not have the shape of the parameter it targets."""


class DuplicateTargetError(ShuttleError, ValueError):
    """Two keys of one adapter resolve onto the same parameter (or overlapping rows of it)."""


class InvalidStrengthError(ShuttleError, ValueError):
    """A strength or scale is NaN, infinite or not a number."""


class NonFiniteAdapterError(ShuttleError, ValueError):
    """An adapter tensor holds NaN or infinity, or a merge would produce them."""


class UnsupportedLayerError(ShuttleError, TypeError):
    """A patch kind cannot be applied to the layer it targets in the requested mode."""


class MissingDependencyError(ShuttleError, ImportError):
    """An optional dependency is needed; the message names the extra to install."""


class MissingParameterError(ShuttleError, LookupError):
    """A model parameter gets a value from neither the checkpoint nor an adapter (a load)."""
