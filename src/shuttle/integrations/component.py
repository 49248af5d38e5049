"""One module under an :class:`~shuttle.integrations.handle.OffloadHandle`: its bookkeeping
(and what its calls' activations teach it), the hook that activates it on call, the checks
before it is taken and how it is given back.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shuttle.cache import ModelSpec
from shuttle.errors import BudgetTooSmallError, OffloadError
from shuttle.hooks import ModuleHook, hooks_of, remove_hook
from shuttle.integrations.activations import CallShrinker, Reading, predicted_reserve
from shuttle.offload import ResidencyPlan
from shuttle.offload.host_storage import HostStorage
from shuttle.weights.upcast import Upcasting

__all__ = ["Active", "ActivateHook", "Component", "check_free", "reporting", "restore"]

logger = logging.getLogger(__name__)

_REPORTING: dict[tuple[type, str, Any], type] = {}


def reporting(cls: type, name: str, fget: Callable[[Any], Any], doc: str,
              key: Any = None) -> type:
    """A subclass of ``cls`` (adding no state) whose property ``name`` is ``fget``: what an
    offloaded module reports in place of what its class reads from its parameters (a
    ``device``, a ``dtype``), which an instance attribute cannot shadow. The handle gives the
    module this class (``classes=``) and its own back at ``remove()``. One subclass per
    (``cls``, ``name``, ``key``), made once: ``key`` names what ``fget`` returns when it is a
    constant.
    """
    sub = _REPORTING.get((cls, name, key))
    if sub is None:
        sub = _REPORTING[cls, name, key] = type(cls.__name__, (cls,), {
            name: property(fget, doc=doc), "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return sub


@dataclass
class Component:
    """One module under an :class:`~shuttle.integrations.handle.OffloadHandle`: its spec,
    where its tensors were, what the handle installed on it, its plan and budgets.
    """

    name: str
    module: torch.nn.Module
    spec: ModelSpec
    devices: dict[tuple[int, str, bool], torch.device]  # (module id, name, is_param) -> device
    hook: ModuleHook | None = None
    wrapped: list[str] = field(default_factory=list)  # entry methods set on the instance
    attrs: list[str] = field(default_factory=list)  # instance attributes set by the handle
    own_class: type | None = None  # the module's class, while the handle gives it another
    upcasting: Upcasting | None = None  # its float8 weights cast as each layer runs
    plan: ResidencyPlan | None = None  # chosen at capture, again as activations are measured
    paths: tuple[str, ...] = ()  # its block lists (empty: moved whole)
    floor: int = 0  # device weight bytes at its floor (nothing resident, one slot per list)
    reserve: int | None = None  # device bytes kept for its activations (None: not measured)
    shrink: CallShrinker | None = None
    shrunk: bool = False
    share: int | None = None  # its host ceiling (a disk tier), None: all in host memory
    host_floor: int = 0  # the least its share may be
    captured: int = 0  # host bytes charged to the cache for the module itself (its floor)
    host_lease: contextlib.ExitStack | None = None  # holds the rest of its share in the cache

    @property
    def need(self) -> int:
        """Device weight bytes while active."""
        return self.plan.device_bytes if self.plan is not None else 0

    def foresee(self, budget: int, device: torch.device, method: str, args: tuple[Any, ...],
                kwargs: Mapping[str, Any]) -> None:
        """Shrink the module's calls before a call that is not measured yet when its shrinker
        predicts activations that do not fit beside its floor in ``budget``
        (:func:`~shuttle.integrations.activations.predicted_reserve`): without it, that call
        would go over the budget once before being measured.
        """
        if self.shrink is None or self.shrunk:
            return
        predicted = self.shrink.predict(method, args, kwargs)
        if predicted is None or predicted_reserve(predicted, device) <= budget - self.floor:
            return
        self.shrink.enable()
        self.shrunk = True
        logger.info("%s.%s: %d bytes of activations predicted do not fit beside its %d weight "
                    "bytes in vram_budget=%d: its calls are shrunk (e.g. tiled decoding)",
                    self.name, method, predicted, self.floor, budget)

    def learn(self, reading: Reading, budget: int) -> bool:
        """Take in a call's measured activations: True when the module must be planned again
        with its new reserve (its first reading, or one over the reserve). Activations that do
        not fit beside its floor shrink its calls instead, when a shrinker is left (False: the
        next call is measured afresh).

        Raises:
            BudgetTooSmallError: the activations do not fit beside the floor and no shrinker is
                left to try.
        """
        if self.reserve is not None and reading.peak <= self.reserve:
            return False
        room = budget - self.floor  # what the floor leaves for activations
        if reading.peak > room:
            if self.shrink is not None and not self.shrunk:
                self.shrink.enable()
                self.shrunk, self.reserve = True, None  # measured afresh on its next call
                logger.info("%s: %d bytes of activations do not fit beside its %d weight bytes "
                            "in vram_budget=%d: its calls are shrunk (e.g. tiled decoding)",
                            self.name, reading.peak, self.floor, budget)
                return False
            floor = self.floor + reading.peak
            weights = ("its non-block weights and one slot of each block list's largest block"
                       if self.paths else "moved whole")
            raise BudgetTooSmallError(
                f"vram_budget={budget} bytes is below the floor of {self.name!r}, {floor} bytes: "
                f"{self.floor} bytes of weights ({weights}) + {reading.peak} bytes of "
                f"activations and of the caller's tensors beside them measured on its last "
                f"call{' (shrunk)' if self.shrunk else ''}, "
                f"which went over the budget. Give a budget of at least {floor} bytes, or make "
                "its calls smaller (a smaller image or batch, fewer tokens)"
                + ("" if self.paths else
                   f", or stream {self.name!r}: give its block lists in blocks="))
        # The margin is capped by the room: the measured peak itself fits there.
        self.reserve = min(reading.reserve, room)
        return True

    def uninstall(self) -> None:
        """Undo what the handle installed on the module: its float8 upcasting, shrunk calls,
        hook, wrapped methods, attributes and offloaded class.
        """
        if self.upcasting is not None:
            self.upcasting.remove()
            self.upcasting = None
        if self.shrunk and self.shrink is not None:
            self.shrink.restore()
            self.shrunk = False
        if self.hook is not None:
            remove_hook(self.module, self.hook)
        for attr in self.wrapped + self.attrs:
            del self.module.__dict__[attr]
        if self.own_class is not None:
            self.module.__class__ = self.own_class
        self.hook, self.wrapped, self.attrs, self.own_class = None, [], [], None


@dataclass
class Active:
    """A module's activation: the cache lease that holds it and what it was activated with."""

    stack: contextlib.ExitStack  # holds the ModelCache.use() of the activation
    config: tuple  # (adapter keys and strengths, mode) it was activated with
    plan: ResidencyPlan | None  # the plan it was activated with
    need: int  # its device weight bytes
    ahead: bool = False  # activated ahead of its call (its plan may keep fewer blocks)


class ActivateHook(ModuleHook):
    """Runs the module's forward through ``call(name, forward, *args, **kwargs)`` (the handle's
    activation around each call).
    """

    def __init__(self, call: Callable[..., Any], name: str):
        self.call = call
        self.name = name

    def forward(self, module: torch.nn.Module, inner: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
        return self.call(self.name, inner, *args, **kwargs)


def check_free(modules: Mapping[str, torch.nn.Module], methods: Mapping[str, Sequence[str]],
                attrs: Mapping[str, Any], classes: Mapping[str, type]) -> None:
    """Refuse modules offloaded already, a class that is no direct subclass of the module's,
    or instance attributes the handle would set that are set already (another library's hooks).

    Raises:
        OffloadError: any of those; nothing was changed.
    """
    for name, module in modules.items():
        if any(isinstance(h, ActivateHook) for h in hooks_of(module)):
            raise OffloadError(f"{name} is offloaded already; remove() its handle first")
        cls = classes.get(name)
        if cls is not None and type(module) not in cls.__bases__:
            raise OffloadError(f"{name}: classes[{name!r}]={cls.__qualname__} is not a direct "
                               f"subclass of its class {type(module).__qualname__}")
        taken = [a for a in [*methods.get(name, ()), *attrs] if a in module.__dict__]
        if taken:
            raise OffloadError(f"{name}: instance attributes {taken} are set already (another "
                               "library's offload hooks?); remove them before offloading")


def restore(storage: HostStorage, devices: dict[tuple[int, str, bool], torch.device]) -> None:
    """Give every tensor back its original device and its own memory (no host arena); a
    tensor that was on ``meta`` (a module built to be filled from its files) is on ``meta``
    again.
    """
    with torch.no_grad():
        for unit in storage.units:
            where: dict[int, torch.device] = {}
            for b in unit.bindings:  # tied tensors share an entry: they stay tied
                where.setdefault(b.entry, devices[(id(b.module), b.name, b.is_param)])
            if all(d.type == "meta" for d in where.values()):
                # built to be filled from its files: back to meta without reading anything
                # (a unit still on disk, coded there, has no host values to read)
                empty = torch.empty(unit.layout.nbytes, dtype=torch.uint8, device="meta")
                unit.bind(unit.layout.views(empty))
                continue
            # a parameter going back to meta is replaced by bind() (tied names share one)
            unit.bind([v if storage.host == "adopt" and where[i].type == "cpu"
                       else v.to(where[i], copy=True) for i, v in enumerate(unit.host_tensors())])
