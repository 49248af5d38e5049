"""The base of every weight representation, and the registry that finds one for a tensor.

A representation is a dataclass that names its data tensors once in ``tensor_names``; byte
counts, pinning and device copies are derived from that list, so code that moves weights has no
per-format branches. Where a library keeps each of them on its parameter object is declared once
too (``param_attrs``): writing a merged weight back (``write_into``) and re-pointing a parameter
at other memory (``rebind``) are derived from it. Each representation adds the math only it
knows: its logical shape and compute dtype, ``dequantize`` (to float32) and ``encode`` (float32
back to the same representation, data-dependent scales recomputed: the re-encoding after a
merge).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import ClassVar, TypeVar

import torch

from shuttle.errors import ShuttleError, UnmergeableWeightError, UnsupportedLayerError
from shuttle.kernels.rounding import Rounding

__all__ = [
    "REPRESENTATIONS",
    "WeightRepresentation",
    "register_representation",
    "represent",
]


R = TypeVar("R", bound="WeightRepresentation")


@dataclasses.dataclass
class WeightRepresentation:
    """One weight in one storage form. Subclasses are dataclasses.

    Class attributes:
        tensor_names: the dataclass fields that hold tensors (a field may be ``None``); every
            derived operation (``nbytes``, ``to``, ``pin``, ``tensors``) walks this list only.
        mergeable: whether ``encode`` can re-encode a merged float32 weight.
        shape_field: the field giving the logical shape: a tensor of that shape, or the shape.
        compute_field: the field holding the compute dtype.
        param_attrs: declared tensor name -> where the library keeps it on the parameter
            object: an attribute path (``"quant_state.absmax"``; ``"data"`` for the
            parameter's own data), or several paths that must all point at it. Empty: the
            representation has no parameter object of its own to write into or rebind.
    """

    tensor_names: ClassVar[tuple[str, ...]] = ()
    param_attrs: ClassVar[Mapping[str, str | tuple[str, ...]]] = {}
    mergeable: ClassVar[bool] = True
    shape_field: ClassVar[str] = "data"
    compute_field: ClassVar[str] = "compute"

    # -- derived from tensor_names ------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """Declared name -> tensor, leaving out fields that are ``None``."""
        out = {n: getattr(self, n) for n in self.tensor_names}
        return {n: t for n, t in out.items() if t is not None}

    def _map(self: R, fn: Callable[[torch.Tensor], torch.Tensor]) -> R:
        return dataclasses.replace(self, **{n: fn(t) for n, t in self.tensors().items()})

    @property
    def nbytes(self) -> int:
        """Bytes of storage held by the declared tensors (what a cache charges)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def device(self) -> torch.device:
        """The device of the first declared tensor."""
        return next(iter(self.tensors().values())).device

    def to(self: R, device: torch.device | str, non_blocking: bool = False) -> R:
        """A copy of this representation with every declared tensor on ``device``."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin(self: R) -> R:
        """This representation with every declared tensor in page-locked host memory.

        Without an accelerator there is nothing to pin for, and ``self`` is returned as is.
        """
        if not torch.accelerator.is_available():
            return self
        return self._map(lambda t: t if t.is_pinned() else t.pin_memory())

    def is_pinned(self) -> bool:
        """Whether every declared tensor is in page-locked host memory."""
        return all(t.is_pinned() for t in self.tensors().values())

    # -- what each representation knows -------------------------------------------------------

    @property
    def logical_shape(self) -> torch.Size:
        """The shape of the weight this stands for (not of its storage): ``shape_field``'s."""
        v = self._declared(self.shape_field, "logical_shape")
        return v.shape if isinstance(v, torch.Tensor) else torch.Size(v)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype a layer computes in with this weight: ``compute_field``'s value."""
        return self._declared(self.compute_field, "compute_dtype")

    def _declared(self, field: str, what: str) -> object:
        if not hasattr(self, field):
            raise NotImplementedError(
                f"{type(self).__qualname__} has no field {field!r}: set the class attribute "
                f"{'shape_field' if what == 'logical_shape' else 'compute_field'} or define "
                f"{what}")
        return getattr(self, field)

    def dequantize(self) -> torch.Tensor:
        """The weight as a float32 tensor of ``logical_shape``, on this representation's device."""
        raise NotImplementedError(f"{type(self).__qualname__} must define dequantize")

    def encode(self: R, x: torch.Tensor, rounding: Rounding = "nearest",
               generator: torch.Generator | None = None) -> R:
        """``x`` (float32, ``logical_shape``) encoded in this representation's form.

        Data-dependent parameters (scales) are recomputed from ``x``; the form (dtypes, scale
        granularity) is kept. ``generator`` drives stochastic rounding.

        Raises:
            UnmergeableWeightError: the representation cannot be re-encoded (``mergeable`` is
                False).
        """
        raise UnmergeableWeightError(
            f"{type(self).__qualname__} weights cannot be merged into (their encoding is fixed "
            'offline); apply the adapter with mode="dynamic" instead'
        )

    def merge_lowrank(self: R, up: torch.Tensor, down: torch.Tensor, seg: list[int],
                      scales: list[float], *, rounding: Rounding = "nearest",
                      seed: int = 0) -> R | None:
        """This weight plus ``sum_i scales[i] * up[:, seg_i] @ down[seg_i]``, re-encoded by a
        fused kernel that never materializes the dense float32 weight; ``None`` where this
        representation has no such kernel for these inputs (the caller then dequantizes,
        applies and encodes). ``seed`` drives stochastic rounding.

        Args:
            up: (rows, R) and down: (R, cols) low-rank factors, ranks concatenated.
            seg: rank offsets of each contribution, ``[0, ..., R]``.
            scales: each contribution's scale (strength x alpha / rank).
        """
        return None

    @property
    def writable(self) -> bool:
        """Whether :meth:`write_into` can store this form into a parameter."""
        return bool(self.param_attrs)

    def write_into(self, param: torch.Tensor) -> None:
        """Store this representation into ``param`` (a parameter of the same form) in place:
        every declared tensor copied into the parameter's own (their storage kept, so whoever
        holds them, a module, a pinned host copy, an offloader, sees the new values).

        Raises:
            UnsupportedLayerError: ``param`` has another form (other declared tensors, or of
                other shapes or dtypes, or another logical shape).
            NotImplementedError: the representation declares no ``param_attrs``.
        """
        if not self.param_attrs:
            raise NotImplementedError(
                f"{type(self).__qualname__} cannot write itself into a parameter; merge into "
                "its weights through their own representation")
        target = type(self).from_tensor(param)
        mine, theirs = self.tensors(), target.tensors()
        if mine.keys() != theirs.keys() or target.logical_shape != self.logical_shape or any(
                (mine[n].shape, mine[n].dtype) != (theirs[n].shape, theirs[n].dtype)
                for n in mine):
            form = {n: (tuple(t.shape), t.dtype) for n, t in mine.items()}
            other = {n: (tuple(t.shape), t.dtype) for n, t in theirs.items()}
            raise UnsupportedLayerError(
                f"cannot write a {type(self).__qualname__} of {form} into a parameter of "
                f"another form, {other}: write it into a parameter of the same form, or build "
                "a new parameter")
        with torch.no_grad():
            for n, t in mine.items():
                theirs[n].copy_(t)

    def rebind(self, param: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Point ``param``'s storage tensors at ``tensors`` (declared name -> tensor), no copy.

        ``tensors`` holds exactly the declared tensors this representation has (those of
        :meth:`tensors`), of the same dtypes and shapes, possibly on another device: the
        offloader moves a quantized parameter by rebinding it to views of host or device
        buffers. Only ``param`` and ``tensors`` are read, never this representation's own
        tensors. A representation without ``param_attrs`` cannot be offloaded.
        """
        if not self.param_attrs:
            raise NotImplementedError(
                f"{type(self).__qualname__} cannot rebind a parameter's storage tensors, so the "
                "offloader cannot move it; declare its param_attrs (or dequantize the weight)")
        for name, t in tensors.items():
            paths = self.param_attrs[name]
            for path in (paths,) if isinstance(paths, str) else paths:
                *outer, last = path.split(".")
                obj = param
                for a in outer:
                    obj = getattr(obj, a)
                setattr(obj, last, t)

    @classmethod
    def accepts(cls, tensor: torch.Tensor) -> bool:
        """Whether :func:`represent` should wrap ``tensor`` in this class (default: never)."""
        return False

    @classmethod
    def from_tensor(cls: type[R], tensor: torch.Tensor) -> R:
        """Wrap a tensor that :meth:`accepts` said yes to."""
        raise NotImplementedError(f"{cls.__qualname__} accepts tensors but cannot wrap them")


REPRESENTATIONS: dict[str, type[WeightRepresentation]] = {}


def register_representation(name: str) -> Callable[[type[R]], type[R]]:
    """Class decorator: register a :class:`WeightRepresentation` under ``name``.

    :func:`represent` asks the most recently registered classes first, so a user's class can
    claim tensors that a built-in one would also accept.

    Raises:
        ShuttleError: ``name`` is registered already, or the class is no representation.
    """

    def deco(cls: type[R]) -> type[R]:
        if not (isinstance(cls, type) and issubclass(cls, WeightRepresentation)):
            raise ShuttleError(f"register_representation({name!r}) needs a WeightRepresentation "
                               f"subclass, got {cls!r}")
        if name in REPRESENTATIONS:
            raise ShuttleError(f"weight representation {name!r} is registered already "
                               f"({REPRESENTATIONS[name].__qualname__}); pick another name")
        REPRESENTATIONS[name] = cls
        return cls

    return deco


def represent(tensor: torch.Tensor | WeightRepresentation) -> WeightRepresentation:
    """The representation of ``tensor``: the last registered class that accepts it.

    Args:
        tensor: a tensor (plain float, float8, or a type a registered class accepts); a
            :class:`WeightRepresentation` is returned unchanged.

    Raises:
        ShuttleError: no registered representation accepts it.
    """
    if isinstance(tensor, WeightRepresentation):
        return tensor
    for cls in reversed(list(REPRESENTATIONS.values())):
        if cls.accepts(tensor):
            return cls.from_tensor(tensor)
    raise ShuttleError(
        f"no weight representation accepts a {type(tensor).__qualname__} of dtype "
        f"{getattr(tensor, 'dtype', None)}; register one with "
        "shuttle.weights.register_representation"
    )
