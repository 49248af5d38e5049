"""A patch kind as one registered object: its roles, construction, spelling and dynamic form.

Generic code reads :data:`PATCH_KINDS` and calls the kind; it never names one:

    formats.roles         the key suffixes of each tensor role         ``kind.roles``
    formats.assemble      a module's patches from its tensors by role  ``kind.build(found)``
    formats.writer        the kohya/comfy keys of a patch              ``kind.spell(...)``
    apply.dynamic_layer   whether a patch runs beside the layer as     ``kind.lowrank(patch)``
                          low-rank factors (the Linear tiers, a conv or
                          lookup residual) or joins the weight residual
    targets.resolve       which parameter of the module it updates,   ``kind.place(...)``
                          when the file does not say (PEFT's
                          ``target_parameters``)
    apply (merge)         its contribution: the patch class's own ``apply``/``delta``

A new kind is one file: its :class:`~shuttle.patches.patch.Patch` subclass and a
:class:`PatchKind` subclass under :func:`register_kind`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import torch

from shuttle.errors import AdapterFormatError, UnsupportedFormatError
from shuttle.patches.patch import Patch, Tensorish, materialize

if TYPE_CHECKING:
    from shuttle.patches.lowrank import LowRank

__all__ = ["PATCH_KINDS", "Found", "PatchKind", "register_kind", "register_patch",
           "spell_patch"]

# "main": the module's one weight update (two main patches on one module are an error);
# "wrap": replaces the main patch with one built around it (DoRA); "extra": added after it.
Stage = Literal["main", "wrap", "extra"]
STAGES: tuple[Stage, ...] = ("main", "wrap", "extra")


@dataclasses.dataclass
class Found:
    """One module's tensors by role, as a kind's :meth:`PatchKind.build` reads them.

    Attributes:
        module: the module key (for messages).
        tensors: role -> ``(file key, tensor or lazy reference)``.
        scale: rank -> the scale of a low-rank update (``alpha / rank`` by the format's and
            config's rules, checked finite); ``None`` for a kind without a rank.
        alpha: the module's ``alpha`` tensor as a float, if it has one.
        transposed: the config stores factors transposed (PEFT ``fan_in_fan_out``).
        fmt: the format's reading options (its ``split_qkv_saves``, ``lokr_layout``).
        source: how to name the adapter in messages.
        main: the module's main weight patch built so far (read by "wrap" and "extra" kinds).
    """

    module: str
    tensors: Mapping[str, tuple[str, Tensorish]]
    scale: Callable[[int | None], float]
    alpha: float | None = None
    transposed: bool = False
    fmt: Any = None
    source: str = "adapter"
    main: Patch | None = None

    def get(self, role: str) -> Tensorish | None:
        """The tensor of ``role``, or None."""
        return self.tensors[role][1] if role in self.tensors else None

    def key(self, role: str) -> str:
        """The file key that gave ``role``."""
        return self.tensors[role][0]

    def has(self, *roles: str) -> bool:
        """Whether any of ``roles`` is present."""
        return any(r in self.tensors for r in roles)

    def need(self, *roles: str) -> None:
        """Raise :class:`AdapterFormatError` unless every one of ``roles`` is present."""
        missing = [n for n in roles if n not in self.tensors]
        if missing:
            have = ", ".join(repr(k) for k, _ in self.tensors.values())
            raise AdapterFormatError(
                f"{self.source}: module {self.module!r} has {have} but lacks its "
                f"{' and '.join(missing)} tensor(s); the file is incomplete. Export the adapter "
                "again."
            )


class PatchKind:
    """The behaviour of one patch kind; subclasses override what their kind has.

    Class attributes:
        name: the kind's name (also the patch class's ``kind``).
        patch: the patch class; its ``apply``/``delta`` are the kind's merge contribution.
        roles: role -> spellings of the key suffix after ``"<module>."`` (after
            ``"<module>_"`` where it starts with ``_``); a role read only by :meth:`build`
            from a key another rule names has no spellings.
        factor_roles: roles holding matrices or conv kernels (at least 2-D, none empty).
        integer_roles: roles that may hold integers (flags, an integer buffer's value);
            every other role must be floating point.
        stage: ``"main"``, ``"wrap"`` or ``"extra"`` (see :data:`STAGES`).
        replaces: its patch replaces the parameter: another update of it would be lost (and
            a load takes the value from it where the checkpoint has none).
        payload: its patch carries a whole tensor of the parameter's shape (a difference or a
            value): one that reaches no parameter is reported by name.
    """

    name: ClassVar[str]
    patch: ClassVar[type[Patch]]
    roles: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    factor_roles: ClassVar[frozenset[str]] = frozenset()
    integer_roles: ClassVar[frozenset[str]] = frozenset()
    stage: ClassVar[Stage] = "extra"
    replaces: ClassVar[bool] = False
    payload: ClassVar[bool] = False

    def build(self, found: Found) -> list[Patch]:
        """The patches this kind makes of a module's tensors (called when one of its roles is
        present); a "main" or "wrap" kind gives at most one.

        Raises:
            AdapterFormatError: the tensors do not form a patch of this kind.
        """
        return []

    def spell(self, module: str, patch: Patch, to: str, tensors: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
        """The ``kohya``/``comfy`` keys and tensors of ``patch`` on module key ``module``.

        Args:
            module: the module's name in the written file.
            patch: a patch of this kind.
            to: ``"kohya"`` or ``"comfy"`` (for messages and spellings that differ).
            tensors: the patch's own tensors by field, read.

        Raises:
            UnsupportedFormatError: ``to`` cannot express this patch.
        """
        raise UnsupportedFormatError(
            f"module {module!r}: patch kind {self.name!r} has no {to} spelling (override "
            "spell() in its PatchKind to add one)")

    def place(self, patch: Patch, params: Mapping[str, tuple[int, ...]],
              transposed: bool | None, ordered: bool) -> Patch | str:
        """``patch`` on its module's parameter, or a reason it fits none: a kind whose files
        name the module but not the parameter chooses it here by shape. The default keeps
        ``patch.param``.

        Args:
            patch: a patch of this kind.
            params: the module's parameters (name -> shape), in the order the module registers
                them when ``ordered``.
            transposed: the module's ``is_transposed`` (stacked experts stored (E, in, out));
                None when the shapes come without the module.
            ordered: whether ``params`` is in registration order.
        """
        return patch

    def lowrank(self, patch: Patch) -> LowRank | None:
        """``patch`` as low-rank factors that a dynamic forward runs beside the layer (the
        Linear tiers, a conv or lookup residual), or None: it joins the float32 weight
        residual ``W + request * (patch(W) - W)``, right for any patch and any module.
        """
        return None


PATCH_KINDS: dict[str, PatchKind] = {}
K = TypeVar("K", bound=type[PatchKind])
P = TypeVar("P", bound=type[Patch])


def register_kind(cls: K) -> K:
    """Class decorator adding one instance of the :class:`PatchKind` subclass ``cls`` to
    :data:`PATCH_KINDS` under ``cls.name``, and naming its patch class's ``kind``.
    """
    assert cls.name not in PATCH_KINDS, f"patch kind {cls.name!r} registered twice"
    cls.patch.kind = cls.name
    PATCH_KINDS[cls.name] = cls()
    return cls


def register_patch(kind: str) -> Callable[[P], P]:
    """Class decorator registering a patch class with the default :class:`PatchKind`: built in
    code only (no roles in files), no spelling, a weight residual in a dynamic forward.
    """

    def deco(patch_cls: P) -> P:
        register_kind(type(f"{patch_cls.__name__}Kind", (PatchKind,),
                           {"name": kind, "patch": patch_cls}))
        return patch_cls

    return deco


def kind_of(patch: Patch) -> PatchKind:
    """The registered kind of ``patch``."""
    return PATCH_KINDS[patch.kind]


def spell_patch(module: str, patch: Patch, to: str) -> dict[str, torch.Tensor]:
    """The ``kohya``/``comfy`` keys of ``patch`` on ``module``, from its kind's spelling.

    Raises:
        UnsupportedFormatError: the kind has no spelling in ``to``, or a scale of 0 (which
            readers take as alpha = rank).
    """
    t = {k: materialize(v) for k, v in patch.tensors() if not k.startswith("inner.")}
    if patch.rank is not None and getattr(patch, "scale", None) == 0:
        raise UnsupportedFormatError(
            f"module {module!r}: scale 0 would be written as alpha 0, which {to} readers take "
            "as alpha = rank (scale 1); convert to peft instead."
        )
    return kind_of(patch).spell(module, patch, to, t)


def alpha_tensor(patch: Patch) -> torch.Tensor:
    """The ``alpha`` a low-rank kind is written with: ``scale * rank`` in float64 (1 without a
    rank), so that reading it back gives the same scale.
    """
    rank = patch.rank
    scale: float = getattr(patch, "scale", 1.0)
    return torch.tensor(scale * rank if rank is not None else 1.0, dtype=torch.float64)
