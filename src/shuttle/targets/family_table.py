"""Family maps that are tables: an original (upstream) module name -> where it lives now.

Most model families differ from their diffusers port by renames and row splits only. Such a
family is a function that reads the model's own names once and returns a table from each
module's original path to its place in the model (a path, or :class:`~shuttle.targets.Split`
rows). :func:`family_table` turns that function into a family map: it builds the table once
per :class:`~shuttle.targets.ModelNames`, strips the prefixes adapters put before original names
(``diffusion_model.``, kohya's ``lora_unet_``, ...), and looks a key up with dots and with
kohya's underscores alike. Building forward from the model's names, like
:meth:`ModelNames.kohya_candidates`, avoids guessing where a kohya name's dots were.

The other direction, a diffusers-named adapter on a model that keeps the original names (a
ComfyUI-style checkpoint loaded as is), reuses the same table: :func:`reverse_table` gives the
family the names the model would have in diffusers' layout (a rename of its own names, fused
layers cut into their parts), builds the forward table on those and inverts it, so each
correspondence is written once.

Most families declare that correspondence as one :data:`Layout` of path templates: the forward
table is :func:`layout_table` of it on a diffusers model, and the spelling that gives an
original-layout model its diffusers names is :func:`layout_spelling` of the same declaration.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import weakref
from collections.abc import Callable, Iterable
from typing import Union

from shuttle.targets.family import FamilyMap
from shuttle.targets.names import ModelNames
from shuttle.targets.split import MappingValue, Split

__all__ = ["Layout", "Placed", "Table", "family_table", "half_swap", "invert", "layout_spelling",
           "layout_table", "renamed", "respelled", "respelled_reverse", "reverse_table",
           "stacked", "swapped_halves"]

Table = dict[str, MappingValue]  # original module path (dotted) -> place in the model

# Prefixes before original names: kohya/musubi-tuner, LyCORIS, ComfyUI and trainers that save
# the checkpoint's own keys, PEFT, diffusers-style component names. Stripped one at a time.
_PREFIXES = ("lora_unet_", "lora_transformer_", "lycoris_", "base_model.model.",
             "model.diffusion_model.", "diffusion_model.", "transformer.", "unet.", "model.")


class _Index:
    """A table indexed by its dotted keys and by their kohya spellings.

    An underscored spelling two original paths share is left out (kohya's name cannot tell
    them apart); the dotted spellings still reach both.
    """

    def __init__(self, table: Table):
        self.dotted = table
        self.underscored: Table = {}
        clashes = set()
        for path, value in table.items():
            key = path.replace(".", "_")
            if key in self.underscored and self.underscored[key] != value:
                clashes.add(key)
            self.underscored[key] = value
        for key in clashes:
            del self.underscored[key]

    def get(self, module: str) -> MappingValue | None:
        for key in _spellings(module):
            value = self.dotted.get(key)
            if value is None:
                value = self.underscored.get(key.replace(".", "_"))
            if value is not None:
                return value
        return None


def _spellings(module: str) -> list[str]:
    """``module``, then with one more known prefix stripped each time."""
    out = [module]
    while True:
        key = out[-1]
        prefix = next((p for p in _PREFIXES if key.startswith(p) and len(key) > len(p)), None)
        if prefix is None:
            return out
        out.append(key[len(prefix):])


def family_table(build: Callable[[ModelNames], Table | None]) -> FamilyMap:
    """A family map from ``build(names)``, the family's table for a model (None: not this family).

    The table is built once per :class:`ModelNames` (resolving one adapter asks for every key).
    """
    tables: weakref.WeakKeyDictionary[ModelNames, _Index | None] = weakref.WeakKeyDictionary()

    @functools.wraps(build)
    def lookup(module: str, names: ModelNames) -> MappingValue | None:
        if names not in tables:
            table = build(names)
            tables[names] = _Index(table) if table else None
        index = tables[names]
        return None if index is None else index.get(module)

    return lookup


def stacked(names: ModelNames, paths: list[str] | tuple[str, ...]) -> MappingValue | None:
    """Splits sending consecutive row bands of a fused update to ``paths``, in that order, each
    band as high as that layer's weight (None when a layer is missing).

    A fused ``qkv`` of (3 * h, in) onto ``to_q``, ``to_k``, ``to_v``: rows 0:h, h:2h, 2h:3h;
    grouped key/value heads give unequal bands, read from the layers themselves.
    """
    heights = [names.shapes.get(f"{p}.weight") for p in paths]
    if any(h is None for h in heights):
        return None
    splits, start = [], 0
    for p, h in zip(paths, heights, strict=True):
        splits.append(Split(p, (start, start + h[0])))
        start += h[0]
    return splits


def half_swap(names: ModelNames, path: str) -> MappingValue | None:
    """An adaLN projection's (shift, scale) rows onto the (scale, shift) rows of ``path``, as
    diffusers' ``AdaLayerNormContinuous`` orders them (None when ``path`` is missing or odd).
    """
    shape = names.shapes.get(f"{path}.weight")
    if shape is None or shape[0] % 2:
        return None
    h = shape[0] // 2
    return [Split(path, (0, h), (h, 2 * h)), Split(path, (h, 2 * h), (0, h))]


@dataclasses.dataclass(frozen=True)
class Placed:
    """A place in a :data:`Layout` whose rows a function decides.

    ``place(names, paths)`` gets the model's paths of ``parts`` (root and block index filled
    in) and returns the mapping value, or None where the model has no such place. ``parts``
    are also the diffusers names the original layer is spelled as (:func:`layout_spelling`):
    one path for a rename, several for a fused layer cut into row bands.
    """

    parts: str | tuple[str, ...]
    place: Callable[[ModelNames, tuple[str, ...]], MappingValue | None]


# A family's correspondence, declared once: original module path template -> its place in
# diffusers' layout ("{i}": a block index, the same on both sides). A place is a diffusers
# path template (a rename), a tuple of them (a fused original layer whose rows stack those
# layers in order, each as high as its weight: :func:`stacked`), or a :class:`Placed`.
Layout = dict[str, Union[str, tuple[str, ...], Placed]]  # noqa: UP007 - a runtime alias


def swapped_halves(path: str) -> Placed:
    """An adaLN projection whose (shift, scale) halves are diffusers' (scale, shift) at ``path``
    (:func:`half_swap`).
    """
    return Placed(path, lambda names, paths: half_swap(names, paths[0]))


def _parts(place: str | tuple[str, ...] | Placed) -> tuple[str, ...]:
    parts = place.parts if isinstance(place, Placed) else place
    return (parts,) if isinstance(parts, str) else parts


def _block_indices(names: ModelNames, prefix: str) -> list[int]:
    """The indices N of the modules ``<prefix>N`` or ``<prefix>N.<...>`` the model has."""
    found = set()
    for path in names.modules:
        if path.startswith(prefix) and (m := re.match(r"(\d+)(?:\.|$)", path[len(prefix):])):
            found.add(int(m.group(1)))
    return sorted(found)


def layout_table(names: ModelNames, root: str, layout: Layout) -> Table:
    """The forward table of ``layout`` for the diffusers model below ``root``.

    A template with ``{i}`` is written out for every block index the model has where its
    (first) diffusers path starts; a place the model lacks (a guidance embedder, a pre-only
    block's output projection) is left out.
    """
    indices: dict[str, list[int]] = {}  # diffusers prefix before "{i}" -> the model's indices
    table: dict[str, MappingValue | None] = {}
    for original, place in layout.items():
        parts = _parts(place)
        each: list[int | None] = [None]
        if "{i}" in original:
            prefix = root + parts[0].partition("{i}")[0]
            if prefix not in indices:
                indices[prefix] = _block_indices(names, prefix)
            each = list(indices[prefix])
        for i in each:
            paths = tuple(root + p.format(i=i) for p in parts)
            if isinstance(place, Placed):
                value = place.place(names, paths)
            elif isinstance(place, tuple):
                value = stacked(names, paths)
            else:
                value = paths[0]
            table[original.format(i=i)] = value
    return {o: v for o, v in table.items()
            if v is not None and (not isinstance(v, str) or names.has_module(v))}


def layout_spelling(layout: Layout) -> Respelling:
    """The :data:`Respelling` of ``layout``: each original template spelled as its diffusers
    path(s), for :func:`respelled_reverse`.
    """
    return {o: p.parts if isinstance(p, Placed) else p for o, p in layout.items()}


# An original-layout model's root and the names it would have in diffusers' layout (or None).
DiffusersNames = Callable[[ModelNames], "tuple[str, ModelNames] | None"]


def reverse_table(forward: Callable[[ModelNames], Table | None],
                  diffusers_names: DiffusersNames) -> Callable[[ModelNames], Table | None]:
    """The table builder for models in a family's original layout, from its forward builder.

    ``diffusers_names(names)`` recognizes the original layout (None: not this family) and
    returns its root with the model's names as diffusers would spell them, relative to that
    root. The forward table built on those names, inverted (:func:`invert`), sends each
    diffusers module path to its original module under the root: a rename, or rows of a
    fused layer. Wrap the result in :func:`family_table` and register it.
    """

    def build(names: ModelNames) -> Table | None:
        found = diffusers_names(names)
        if found is None:
            return None
        root, diffusers = found
        table = forward(diffusers)
        return invert(table, root) if table else None

    build.__name__ = build.__qualname__ = f"{forward.__name__}_reversed"
    build.__doc__ = f"diffusers module path -> original place, inverting {forward.__name__}."
    return build


def invert(table: Table, root: str) -> Table:
    """A forward table (original path -> diffusers place, diffusers paths relative) turned
    around: diffusers path -> ``root`` + original path, or the splits of its rows.

    ``Split(d, source_rows=s, rows=r)`` under original ``o`` (rows ``s`` of ``o``'s update go
    to rows ``r`` of ``d``) becomes ``Split(root + o, source_rows=r, rows=s)`` under ``d``, its
    parameter renames swapped. A place given as ``(path, rows)`` has no inverse (the rest of
    that layer's rows would go nowhere) and is left out.
    """
    out: dict[str, MappingValue] = {}
    for original, place in table.items():
        if isinstance(place, str):
            out.setdefault(place, root + original)
        elif isinstance(place, list):
            for s in place:
                splits = out.setdefault(s.path, [])
                if isinstance(splits, list):
                    splits.append(Split(root + original, s.rows, s.source_rows,
                                        tuple((model, adapter) for adapter, model in s.params)))
    return out


def renamed(names: ModelNames, root: str,
            rename: Callable[[str, tuple[int, ...]], Iterable[tuple[str, tuple[int, ...]]]]
            ) -> ModelNames:
    """The names below ``root`` as ``rename(relative parameter, shape)`` spells them: each
    yields ``(new relative name, shape)`` pairs, none to drop the parameter, several to cut a
    fused layer into its parts.
    """
    params = {}
    for name, shape in names.shapes.items():
        if name.startswith(root):
            params.update(rename(name[len(root):], tuple(shape)))
    return ModelNames(params)


# Original module path templates -> diffusers path templates ("{i}": a block index), a tuple
# of them for a fused original layer whose rows stack those layers.
Respelling = dict[str, "str | tuple[str, ...]"]


# (model names, root, number of layers, fused weight's shape) -> the layers' row heights
Bands = Callable[[ModelNames, str, int, tuple[int, ...]], list[int]]


def respelled(names: ModelNames, root: str, spelling: Respelling,
              bands: Bands | None = None) -> ModelNames:
    """The names below ``root`` in diffusers' spelling, by templates (see :data:`Respelling`).

    A bare parameter matches a template by its whole name, any other by its module's. A fused
    layer's parameters are cut into row bands: two halves, or for three or four parts a query
    as high as the layer's input and the rest shared (``qkv``: ``[in, k, k]`` with
    ``2k = out - in``, grouped key/value heads included; ``linear1``: ``[in, in, in, mlp]``).
    ``bands`` gives the heights instead, where the family knows them otherwise. Only the names
    and heights are made up; the forward table decides where rows go.
    """
    patterns = [(re.compile(re.escape(o).replace(re.escape("{i}"), r"(\d+)")), d)
                for o, d in spelling.items()]

    def place(path: str) -> str | tuple[str, ...] | None:
        for pattern, d in patterns:
            if m := pattern.fullmatch(path):
                i = m.group(1) if pattern.groups else None
                return d.format(i=i) if isinstance(d, str) else tuple(x.format(i=i) for x in d)
        return None

    def rename(param: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        if isinstance(bare := place(param), str):
            return [(bare, shape)]
        module, _, leaf = param.rpartition(".")
        d = place(module)
        if d is None:
            return []
        if isinstance(d, str):
            return [(f"{d}.{leaf}", shape)]
        weight = tuple(names.shapes.get(f"{root}{module}.weight", shape))
        return [(f"{part}.{leaf}", (h, *shape[1:]))
                for part, h in zip(d, bands(names, root, len(d), weight) if bands
                                      else _bands(len(d), weight), strict=True)]

    return renamed(names, root, rename)


def respelled_reverse(forward: Callable[[ModelNames], Table | None], markers: tuple[str, ...],
                      spelling: Respelling, bands: Bands | None = None) -> FamilyMap:
    """The family map for models in ``forward``'s original layout: those with every parameter
    of ``markers`` below one of their roots, their names respelled by ``spelling``
    (:func:`respelled`, fused layers cut by ``bands`` if given), the forward table inverted
    (:func:`reverse_table`).
    """

    def as_diffusers(names: ModelNames) -> tuple[str, ModelNames] | None:
        for root in names.roots:
            if all(f"{root}{m}" in names.shapes for m in markers):
                return root, respelled(names, root, spelling, bands)
        return None

    return family_table(reverse_table(forward, as_diffusers))


def _bands(n: int, weight: tuple[int, ...]) -> list[int]:
    """Row heights of the ``n`` layers a fused weight of shape ``weight`` stacks."""
    out, inp = weight[0], weight[1] if len(weight) > 1 else 0
    if n == 3 and 0 < inp < out and (out - inp) % 2 == 0:
        return [inp, (out - inp) // 2, (out - inp) // 2]
    if n == 4 and 0 < 3 * inp < out:
        return [inp, inp, inp, out - 3 * inp]
    return [out // n] * n
