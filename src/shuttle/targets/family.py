"""Name tables of model families, tried when the generic rules place no module.

A family map is a function ``(adapter module key, model names) -> mapping value or None`` that
recognizes its own layouts (it should return None quickly for any other model). Registering one
is a decorated function in a new module; :mod:`shuttle.targets.flux` is the example.
"""

from __future__ import annotations

from collections.abc import Callable

from shuttle.targets.names import ModelNames
from shuttle.targets.split import MappingValue

__all__ = ["FAMILY_MAPS", "FamilyMap", "register_family"]

FamilyMap = Callable[[str, ModelNames], "MappingValue | None"]
FAMILY_MAPS: list[FamilyMap] = []


def register_family(fn: FamilyMap) -> FamilyMap:
    """Add ``fn`` to :data:`FAMILY_MAPS`."""
    FAMILY_MAPS.append(fn)
    return fn
