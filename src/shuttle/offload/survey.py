"""What a capture reads: every parameter and buffer of a model checked and laid out in units
(:func:`survey_units`), without changing anything.

A unit's tensors are its :class:`Binding` s (module, name, and the layout entry it points at;
tied tensors share an entry), each entry read from one source: the module's own tensor, a
quantized parameter's storage tensors (as its representation declares them), a DTensor's local
shard, or a checkpoint file's tensor (``sources=``: a model built on ``meta`` is captured
straight from its files; floating dtypes convert while read).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from shuttle.errors import BlockLayoutError, HostBackingError, ShuttleError, UnsupportedLayerError
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.offload.layout import Layout
from shuttle.weights import Fp8Weight, PlainWeight, WeightRepresentation, represent
from shuttle.weights.dtensor import is_dtensor, local_tensor
from shuttle.weights.lossless_file import CodedRef
from shuttle.weights.plain import is_plain_tensor

__all__ = ["CASTABLE", "WIDENED", "Binding", "UnitSurvey", "adopted", "fill_arena", "read_binding",
           "read_entry", "survey_units"]

# Floating-point dtypes a checkpoint tensor is converted between while read (``copy_``
# rounds to nearest even, as ``load_state_dict`` and ``Tensor.to`` do).
CASTABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
# Float8 checkpoint tensors read into a wider floating model tensor: exact, every float8 value
# (e4m3fn: 3 mantissa bits, |x| <= 448; e5m2: 2 bits, |x| <= 57344) is a float16 and bfloat16.
WIDENED = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


class Binding(NamedTuple):
    """Where one layout entry of a unit plugs into the model (a tied tensor: one per name)."""

    module: torch.nn.Module
    name: str
    is_param: bool
    entry: int  # index into the unit's layout
    # A quantized parameter has one binding per storage tensor: ``part`` names it, and ``rep``
    # (its representation, tensors dropped) rebinds the parameter to all of its parts at once.
    rep: WeightRepresentation | None = None
    part: str | None = None
    shard: bool = False  # a DTensor: its local tensor is the entry


class UnitSurvey(NamedTuple):
    """One unit as surveyed: its layout, every binding, and where each entry is read from."""

    name: str
    layout: Layout
    bindings: list[Binding]
    sources: list[Binding]  # per entry, where to read the tensor from
    # per entry, its bytes in a checkpoint file (read from there; a CodedRef: coded by
    # `shuttle compress`, kept coded in the arena, see shuttle.offload.coded)
    files: list[LazyTensor | CodedRef | None]


def _walk(root: torch.nn.Module, stop: set[int]):
    """``(relative path, module)`` of ``root``'s modules, not entering modules in ``stop``."""
    seen: set[int] = set()
    stack = [("", root)]
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield path, module
        for name, child in reversed(module._modules.items()):
            if child is not None and id(child) not in stop:
                stack.append((f"{path}.{name}" if path else name, child))


def _alias_key(t: torch.Tensor) -> tuple:
    # Two registrations of one tensor (tied weights) share storage, offset, shape and stride;
    # meta tensors have no storage, and tied ones are one object.
    if t.device.type == "meta":
        return (t.device, id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            t.stride(), t.dtype)


def _check(t: torch.Tensor, where: str, adopt: bool, sourced: bool = False) -> None:
    if type(t.detach()) is not torch.Tensor:
        raise HostBackingError(
            f"{where} is a {type(t.detach()).__name__}, a tensor subclass that no weight "
            "representation claims: register one (with rebind(); "
            "shuttle.weights.register_representation), dequantize it or keep it out of the model"
        )
    if sourced:  # read from its file: where the module's tensor lies does not matter
        return
    if adopt and t.device.type != "cpu":
        raise HostBackingError(
            f"{where} is on {t.device}; host='adopt' keeps CPU tensors as they are: move the "
            "model to the CPU first, or use host='pinned' (copies)"
        )
    if t.device.type == "meta":
        raise HostBackingError(f"{where} is on the meta device and no checkpoint file supplies "
                               "it: load real weights first (load_state_dict(..., assign="
                               "True)), or give its file in sources=")


def _shard_of(t: torch.Tensor, where: str) -> torch.Tensor:
    """The local tensor of DTensor ``t``.

    Raises:
        HostBackingError: the local tensor is not a plain tensor (a quantized shard).
    """
    local = local_tensor(t)
    if type(local) is not torch.Tensor:
        raise HostBackingError(
            f"{where} is a DTensor whose local shard is a {type(local).__name__}: the offloader "
            "moves DTensors with plain local tensors; dequantize before sharding, or keep it "
            "out of the offloaded blocks")
    return local.detach()


def _quantized(t: torch.Tensor, where: str) -> WeightRepresentation | None:
    """The representation of a quantized parameter (storage tensors, ``rebind``), or None for
    one captured as one tensor (plain, float8, or a tensor no representation claims, which
    :func:`_check` judges).

    Raises:
        HostBackingError: a quantized parameter the offloader cannot move whole: its
            representation cannot ``rebind``, it holds inner tensors the representation does
            not declare, or the representation refuses it.
    """
    if is_plain_tensor(t):
        return None
    try:
        rep = represent(t)
    except UnsupportedLayerError as e:  # claimed, but refused in its present state
        raise HostBackingError(f"{where}: {e}") from e
    except ShuttleError:  # claimed by none: one tensor, as _check judges it
        return None
    if isinstance(rep, (PlainWeight, Fp8Weight)):
        return None
    name = type(t).__qualname__
    if not rep.writable:  # no param_attrs: nothing says where its tensors live
        raise HostBackingError(
            f"{where} is a {name} ({type(rep).__qualname__}), whose representation cannot "
            "rebind its storage tensors, so the offloader cannot move it: declare "
            f"{type(rep).__qualname__}.param_attrs, or dequantize it or keep it out of the model"
        )
    declared = rep.tensors()
    flatten = getattr(t, "__tensor_flatten__", None)
    inner = flatten()[0] if callable(flatten) else []
    missing = [n for n in inner if getattr(t, n, None) is not None
               and not any(getattr(t, n) is d for d in declared.values())]
    if missing:
        raise HostBackingError(
            f"{where} is a {name} with inner tensors {missing} that its representation "
            f"({type(rep).__qualname__}) does not declare; they would stay behind when it "
            "moves: declare them in its tensor_names (and rebind), or dequantize the weight"
        )
    return dataclasses.replace(rep, **dict.fromkeys(declared))


def _parts(t: torch.Tensor, rep: WeightRepresentation) -> dict[str, torch.Tensor]:
    """The storage tensors of quantized parameter ``t``, as its representation declares them."""
    return {n: v.detach() for n, v in represent(t).tensors().items() if n in rep.tensor_names}


def survey_units(model: torch.nn.Module, groups: dict[str, Sequence[torch.nn.Module]],
            adopt: bool, layers: dict[str, torch.nn.Module], skip: frozenset[int] = frozenset(),
            files: Mapping[str, LazyTensor | CodedRef] | None = None,
            ) -> tuple[UnitSurvey, dict[str, list[UnitSurvey]], list[UnitSurvey]]:
    """Check every tensor and lay out every unit, leaving out the parameters whose ids are in
    ``skip``; a tensor whose qualified name (any of its names, when tied) is in ``files`` is
    read from there. Changes nothing.
    """
    files = files or {}
    named = _names(model)  # alias key -> every qualified name of the tensor
    block_ids = {id(b) for blocks in groups.values() for b in blocks}
    layer_ids = {id(m) for m in layers.values()}
    owner: dict[tuple, tuple[str, str]] = {}  # alias key -> (unit, full name)

    def unit(name: str, root: torch.nn.Module, stop: set[int], layer: bool = False
             ) -> UnitSurvey:
        entries: dict[tuple, int] = {}
        specs: list[tuple[torch.dtype, torch.Size]] = []
        bindings, sources = [], []
        read: list[LazyTensor | CodedRef | None] = []

        def add(key: tuple, t: torch.Tensor, full: str, module: torch.nn.Module, path: str,
                leaf: str, kind: bool, rep: WeightRepresentation | None = None,
                part: str | None = None, shard: bool = False) -> None:
            other = owner.setdefault(key, (name, full))
            if other[0] != name:
                raise BlockLayoutError(
                    f"{full} and {other[1]} are one tensor shared between two offload "
                    "units; tie weights within one block or within the rest of the "
                    "model, or leave one of them out of the block paths"
                )
            e = entries.get(key)
            if e is None:
                e = entries[key] = len(specs)
                specs.append((t.dtype, t.shape))
                sources.append(Binding(module, leaf, kind, e, rep, part, shard))
                read.append(_file_of(t, key, named, files))
            bindings.append(Binding(module, leaf, kind, e, rep, part, shard))

        for path, module in _walk(root, stop):
            # A layer unit holds its module's own parameters; its buffers (and everything of
            # the modules around it) stay with the rest, resident while active.
            streamed_params = layer or id(module) in layer_ids
            for kind, table in ((True, module._parameters), (False, module._buffers)):
                if (layer and not kind) or (not layer and kind and streamed_params):
                    continue
                for leaf, t in table.items():
                    if t is None or (kind and id(t) in skip):
                        continue
                    full = ".".join(p for p in (name, path, leaf) if p)
                    if is_dtensor(t):
                        local = _shard_of(t, full)
                        _check(local, full, adopt)
                        add(_alias_key(local), local, full, module, path, leaf, kind, shard=True)
                        continue
                    rep = _quantized(t, full) if kind else None
                    if rep is not None:
                        for part, pt in _parts(t, rep).items():
                            _check(pt, f"{full} ({part})", adopt)
                            add(_alias_key(pt), pt, full, module, path, leaf, True, rep, part)
                        continue
                    key = _alias_key(t)
                    _check(t, full, adopt, any(n in files for n in named.get(key, ())))
                    add(key, t, full, module, path, leaf, kind)
        return UnitSurvey(name, Layout.of(specs), bindings, sources, read)

    rest = unit("", model, block_ids)
    layer_units = [unit(path, m, set(), layer=True) for path, m in layers.items()]
    # Blocks of one group may differ (T5's first block holds the relative attention bias, a
    # UNet's stages differ in width): each keeps its own layout, and the group's ring is sized
    # by its largest streamed block.
    surveyed = {g: [unit(f"{g}.{i}", b, set()) for i, b in enumerate(blocks)]
                for g, blocks in groups.items()}
    return rest, surveyed, layer_units


def _names(model: torch.nn.Module) -> dict[tuple, list[str]]:
    """Alias key -> the qualified names of one plain tensor (several when tied)."""
    out: dict[tuple, list[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for leaf, t in table.items():
                if t is not None and is_plain_tensor(t):
                    out.setdefault(_alias_key(t), []).append(f"{prefix}.{leaf}" if prefix
                                                             else leaf)
    return out


def _file_of(t: torch.Tensor, key: tuple, named: dict[tuple, list[str]],
             files: Mapping[str, LazyTensor | CodedRef]) -> LazyTensor | CodedRef | None:
    """The checkpoint tensor that supplies ``t`` (under any of its names), checked to match:
    the same shape, and the same dtype, or two of :data:`CASTABLE`, or a float8 tensor for a
    float16, bfloat16 or float32 one (:data:`WIDENED`): converted while read.

    Raises:
        HostBackingError: the file's tensor has another shape, or a dtype that is not converted
            (integers; float8 from a wider file tensor: its values would need rounding and a
            scale).
    """
    for name in named.get(key, ()):
        src = files.get(name)
        if src is not None:
            castable = (src.dtype == t.dtype or {src.dtype, t.dtype} <= CASTABLE
                        or (src.dtype in WIDENED and t.dtype in CASTABLE))
            if not castable or tuple(src.shape) != tuple(t.shape):
                raise HostBackingError(
                    f"{name}: the checkpoint's {src.key!r} is {src.dtype} "
                    f"{tuple(src.shape)}, the model's tensor {t.dtype} {tuple(t.shape)}; build "
                    "the model with the checkpoint's config and dtype (floating-point tensors "
                    f"convert between {sorted(str(d) for d in CASTABLE)} while read, and "
                    "float8 ones into any of those)")
            return src
    return None


def adopted(src: LazyTensor | CodedRef, layout: Layout, b: Binding) -> torch.Tensor:
    """A file's tensor kept as it lies (a private map), or converted into memory of its own
    when the model's dtype differs (a coded one: decoded).
    """
    dtype = layout.dtypes[b.entry]
    if isinstance(src, CodedRef):
        return src.load().to(dtype)
    if src.dtype == dtype:
        return src.load()
    return src.load_converted(torch.empty(layout.shapes[b.entry], dtype=dtype))


def read_binding(b: Binding) -> torch.Tensor:
    """The tensor ``b``'s entry is read from in the model (a storage tensor, a local shard)."""
    table = b.module._parameters if b.is_param else b.module._buffers
    if b.rep is not None:
        return _parts(table[b.name], b.rep)[b.part]
    if b.shard:
        return local_tensor(table[b.name]).detach()
    return table[b.name].detach()


def fill_arena(s: UnitSurvey, arena: torch.Tensor) -> None:
    """Fill ``arena`` (laid out by ``s.layout``) with unit ``s``'s tensors."""
    views = s.layout.views(arena)
    with torch.no_grad():
        for b, src in zip(s.sources, s.files, strict=True):
            read_entry(b, src, views[b.entry])


def read_entry(b: Binding, src: LazyTensor | CodedRef | None, view: torch.Tensor) -> None:
    """Fill ``view`` (a contiguous host tensor of entry ``b``'s dtype and shape) from ``src``,
    its checkpoint tensor (None: the module's own tensor).
    """
    if src is None:
        view.copy_(read_binding(b))
    elif isinstance(src, CodedRef):  # decoded (converted too, where the dtype differs)
        view.copy_(src.load())
    elif src.dtype != view.dtype:  # converted piece by piece
        src.load_converted(view)
    else:  # straight from the file into the view: one read, no other copy
        src.load_into(view.reshape(-1).view(torch.uint8))
