"""Name tables of model families, tried when the generic rules place no module.

A family map is a function ``(adapter module key, model names) -> mapping value or None`` that
recognizes its own layouts (it should return None quickly for any other model). Registering one
is a decorated function in a new module; :mod:`shuttle.targets.flux` is the example.

A family may also name the weights an adapter is allowed to widen (more input columns than the
model has: FLUX.1 control LoRAs feed a control image into ``x_embedder``) with
:func:`register_widenable`; every other weight keeps its shape, and an update of another
width is a shape mismatch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from shuttle.targets.names import ModelNames
from shuttle.targets.split import MappingValue

__all__ = ["FAMILY_MAPS", "FamilyMap", "WIDENABLE", "register_family", "register_widenable",
           "widenable"]

FamilyMap = Callable[[str, ModelNames], "MappingValue | None"]
FAMILY_MAPS: list[FamilyMap] = []


def register_family(fn: FamilyMap) -> FamilyMap:
    """Add ``fn`` to :data:`FAMILY_MAPS`."""
    FAMILY_MAPS.append(fn)
    return fn


# model names -> {parameter an adapter may widen: the config attribute of the layer's parent
# that records its input width (``in_channels``), or None}
WidenableMap = Callable[[ModelNames], Mapping[str, "str | None"]]
WIDENABLE: list[WidenableMap] = []


def register_widenable(fn: WidenableMap) -> WidenableMap:
    """Add ``fn`` (model names -> widenable parameters and their config attributes) to
    :data:`WIDENABLE`.
    """
    WIDENABLE.append(fn)
    return fn


def widenable(names: ModelNames) -> dict[str, str | None]:
    """The parameters of the model that any family lets an adapter widen, each with the config
    attribute (of the module holding the layer) that follows its input width, or None.
    """
    return {n: attr for fn in WIDENABLE for n, attr in fn(names).items()}
