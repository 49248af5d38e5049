"""Resolve an adapter's module keys onto a model's parameter names.

Order of rules for one module key:
    1. the caller's ``mapping`` (a dict or a function), which may also give a row range;
    2. kohya names (``lora_unet_``, ``lora_te2_``, ...): the model's forward-built underscore
       spellings, the prefix choosing between components: ``lora_te_``/``lora_te1_`` pin
       ``text_encoder.``, ``lora_te2_`` ``text_encoder_2.``, ``lora_te3_`` ``text_encoder_3.``
       when the model has that root (a CLIP ``text_model.`` level the adapter spells and that
       component lacks never sends the key to another encoder that has one);
    3. dotted names: the key as is, then with adapter prefixes removed (``base_model.model.``,
       ``diffusion_model.``, ``transformer.``, ...) and the model's own roots added, and legacy
       ``.processor.`` segments dropped;
    4. a split projection onto the model's fused one (``to_q`` onto rows of ``to_qkv``).
Then a place on a split layer of a module that runs fused projections (diffusers'
``fuse_qkv_projections`` keeps ``to_q`` beside the ``to_qkv`` the forward reads) also gets its
rows of the fused layer.
A key that no rule places, or that several place equally well, is reported with the reason.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping

import torch

from shuttle.errors import DuplicateTargetError, ShapeMismatchError
from shuttle.formats import LoRA
from shuttle.formats.kohya import KOHYA_PREFIXES
from shuttle.patches import PATCH_KINDS, Patch, PatchKind, select_rows
from shuttle.targets.family import FAMILY_MAPS
from shuttle.targets.fused import fused_candidates, live_fused
from shuttle.targets.names import ADAPTER_PREFIXES, ModelNames
from shuttle.targets.split import MappingValue, Rows, Split

__all__ = ["KeyMapping", "Resolution", "Split", "Target", "resolve"]

# Wrapper levels that adapters spell but newer model code dropped: transformers 5's CLIPTextModel
# has no ``text_model.`` (kohya's ``lora_te1_text_model_...`` and diffusers' keys keep it).
_WRAPPERS = ("text_model.",)
_DROPPED_WRAPPERS = tuple(w.replace(".", "_") for w in _WRAPPERS)

KeyMapping = Mapping[str, MappingValue] | Callable[[str], "MappingValue | None"]


@dataclasses.dataclass(frozen=True)
class Target:
    """One patch placed on one parameter.

    Attributes:
        param: the model's parameter name.
        module_key: the adapter's module key it came from.
        patch: the update.
        rows: ``(start, end)`` rows of the parameter it covers (split q/k/v), or None for all.
    """

    param: str
    module_key: str
    patch: Patch
    rows: Rows | None = None


@dataclasses.dataclass
class Resolution:
    """The outcome of :func:`resolve`: placed patches, and adapter keys left over with why."""

    targets: list[Target]
    unmatched: dict[str, str]


@dataclasses.dataclass(frozen=True)
class _Place:
    path: str
    fused: tuple[int, tuple[str, ...]] | None = None  # (index, group) on a fused projection
    rows: Rows | None = None  # rows of the model's parameter
    source_rows: Rows | None = None  # rows of the adapter's update (one module split in several)
    params: tuple[tuple[str, str], ...] = ()  # (adapter param, model param) renames


def resolve(
    lora: LoRA,
    model: torch.nn.Module | ModelNames | Mapping[str, torch.Size],
    mapping: KeyMapping | None = None,
) -> Resolution:
    """Place every patch of ``lora`` on a parameter of ``model``.

    Args:
        lora: the adapter.
        model: a module, a :class:`ModelNames`, or a dict of parameter name -> shape.
        mapping: module key -> module path (or ``(path, (start, end))`` rows), as a dict or a
            function returning None for keys it leaves to the built-in rules.

    Returns:
        A :class:`Resolution`. Shapes are not checked here (merging does, before any write).

    Raises:
        ShapeMismatchError: a row range (from ``mapping``) is empty or runs past its
            parameter's rows.
        DuplicateTargetError: two module keys of ``lora`` reach the same parameter rows.
    """
    names = model if isinstance(model, ModelNames) else (
        ModelNames.of(model) if isinstance(model, torch.nn.Module) else ModelNames(model))
    unmatched: dict[str, str] = {}
    places: dict[str, list[_Place]] = {}
    for module in lora.modules:
        found = _from_mapping(module, mapping, names, unmatched)
        if found is None and module not in unmatched:
            place = _locate(module, names, unmatched)
            found = [place] if place is not None else None
        if found is None and module in unmatched:
            found = _from_family(module, names, unmatched)
        if found:
            places[module] = found
    _fused_rows(lora, places, names, unmatched)
    _onto_live_fused(places, names, unmatched)
    targets = []
    for module, module_places in places.items():
        for place in module_places:
            for patch in lora.modules[module]:
                placed = _placed(patch, place.path, names)
                if isinstance(placed, str):
                    unmatched[f"{module} ({patch.param})"] = placed
                    continue
                patch = placed
                leaf = dict(place.params).get(patch.param, patch.param)
                param = names.param(place.path, leaf)
                if param is None:
                    unmatched[f"{module} ({patch.param})"] = (
                        f"module {place.path!r} of the model has no parameter {leaf!r}")
                    continue
                if place.source_rows is not None:
                    patch = select_rows(patch, *place.source_rows)
                targets.append(Target(param, module, patch, place.rows))
    _check_rows(targets, names)
    _check_duplicates(targets)
    return Resolution(targets, unmatched)


def _placed(patch: Patch, path: str, names: ModelNames) -> Patch | str:
    """``patch`` on the parameter its kind chooses at ``path`` (PEFT's ``target_parameters``
    factors name the module only), or why none fits.
    """
    kind = PATCH_KINDS[patch.kind]
    if type(kind).place is PatchKind.place:
        return patch
    known = names.transposed is not None
    return kind.place(patch, names.params_of(path),
                      path in names.transposed if names.transposed is not None else None, known)


def _places(module: str, value: MappingValue, names: ModelNames,
            unmatched: dict[str, str], who: str) -> list[_Place] | None:
    """Places from a mapping value: a path, ``(path, rows)``, or a list of :class:`Split`."""
    if isinstance(value, str):
        splits = [Split(value)]
    elif isinstance(value, list):
        splits = [v if isinstance(v, Split) else Split(*v) for v in value]
    else:
        splits = [Split(value[0], rows=value[1])]
    missing = [s.path for s in splits if not names.has_module(s.path)]
    if missing:
        unmatched[module] = f"{who} sends it to {missing[0]!r}, which the model does not have"
        return None
    unmatched.pop(module, None)
    return [_Place(s.path, rows=tuple(s.rows) if s.rows is not None else None,
                   source_rows=tuple(s.source_rows) if s.source_rows is not None else None,
                   params=tuple(s.params))
            for s in splits]


def _from_mapping(module: str, mapping: KeyMapping | None, names: ModelNames,
                  unmatched: dict[str, str]) -> list[_Place] | None:
    if mapping is None:
        return None
    value = mapping(module) if callable(mapping) else mapping.get(module)
    if value is None:
        return None
    return _places(module, value, names, unmatched, "the mapping")


def _from_family(module: str, names: ModelNames, unmatched: dict[str, str]
                 ) -> list[_Place] | None:
    """A model family's own name table (BFL vs diffusers Flux, ...) when the rules failed."""
    for family in FAMILY_MAPS:
        value = family(module, names)
        if value is not None:
            return _places(module, value, names, unmatched, "the model family's name table")
    return None


# The longest kohya prefix a key starts with wins ("lora_te1_" over "lora_te_").
_KOHYA_LONGEST_FIRST = sorted(KOHYA_PREFIXES, key=len, reverse=True)


def _locate(module: str, names: ModelNames, unmatched: dict[str, str]) -> _Place | None:
    kohya = next((p for p in _KOHYA_LONGEST_FIRST if module.startswith(p)), None)
    if kohya is not None:
        rest = module[len(kohya):]
        spellings = [rest] + [rest[len(w):] for w in _DROPPED_WRAPPERS if rest.startswith(w)]
        for name in spellings:
            found = _kohya(name, kohya, names) or _kohya_fused(name, kohya, names)
            if found:
                break
    else:
        found = _dotted(module, names)
        if not found:
            found = [_Place(p.path, (i, g)) for v in _variants(module)
                     for f, i, g in fused_candidates(v)
                     for p in _dotted(f, names, variants=False)]
    found = list({p.path: p for p in reversed(found)}.values())[::-1]  # first place per path
    if len(found) == 1:
        return found[0]
    if not found:
        unmatched[module] = "no module of the model matches this name; pass mapping={...}"
    else:
        paths = ", ".join(repr(p.path) for p in found[:4])
        unmatched[module] = f"ambiguous: matches {paths}; pass mapping={{...}} to choose"
    return None


def _affinity(prefix: str, root: str, roots: list[str]) -> int:
    """0 when a kohya prefix names this root's component, 1 a plausible one, 2 the wrong kind.

    A text encoder prefix pins its component when the model has it (``lora_te2_`` and
    ``text_encoder_2.``): every other root is then the wrong kind. Without it, any text
    encoder root is plausible, and so is the model itself (a text encoder on its own).
    """
    te = ModelNames.text_encoder_index(root)
    if prefix in ("lora_unet_", "lora_transformer_", "lycoris_"):
        return 0 if te is None and root != "text_encoders." else 2
    want = {"lora_te_": 1, "lora_te1_": 1, "lora_te2_": 2, "lora_te3_": 3}[prefix]
    if te == want:
        return 0
    if ModelNames.text_encoder_root(want) in roots:
        return 2
    return 1 if (te is not None or root in ("", "text_encoders.")) else 2


def _kohya(underscored: str, prefix: str, names: ModelNames) -> list[_Place]:
    cands = names.kohya_candidates(underscored)
    if not cands:
        return []
    best = min(_affinity(prefix, root, names.roots) for root, _ in cands)
    if best == 2:
        return []
    return [_Place(path) for root, path in cands if _affinity(prefix, root, names.roots) == best]


def _kohya_fused(underscored: str, prefix: str, names: ModelNames) -> list[_Place]:
    """A split projection's fused spellings (``..._to_q`` -> ``..._to_qkv``)."""
    return [_Place(p.path, (i, g)) for f, i, g in fused_candidates(underscored, "_")
            for p in _kohya(f, prefix, names)]


def _variants(module: str) -> list[str]:
    """The key, then with adapter prefixes stripped (repeatedly) and ``.processor`` dropped."""
    out = [module]
    i = 0
    while i < len(out):
        v = out[i]
        for w in _WRAPPERS:  # a dropped level below a component prefix keeps the prefix
            if f".{w}" in v and v.replace(f".{w}", ".") not in out:
                out.append(v.replace(f".{w}", "."))
        for prefix in ADAPTER_PREFIXES + _WRAPPERS:
            if v.startswith(prefix) and v[len(prefix):] not in out:
                out.append(v[len(prefix):])
        if ".processor." in v and v.replace(".processor.", ".") not in out:
            out.append(v.replace(".processor.", "."))
        i += 1
    return out


def _dotted(module: str, names: ModelNames, variants: bool = True) -> list[_Place]:
    if names.has_module(module):
        return [_Place(module)]
    found = []
    for v in (_variants(module) if variants else [module]):
        for root in names.roots:
            if names.has_module(root + v):
                found.append(_Place(root + v))
        if found:  # the least-stripped spelling that matches wins
            break
    return found


def _fused_rows(lora: LoRA, places: dict[str, _Place], names: ModelNames,
                unmatched: dict[str, str]) -> None:
    """Give each split module placed on a fused projection its row range."""
    groups: dict[tuple[str, tuple[str, ...]], dict[int, str]] = defaultdict(dict)
    for module, module_places in places.items():
        place = module_places[0]
        if place.fused is not None:
            groups[(place.path, place.fused[1])][place.fused[0]] = module
    for (path, group), members in groups.items():
        total = names.shapes[names.param(path, "weight") or path][0]
        outs = {i: _out_rows(lora, m) for i, m in members.items()}
        n = len(group)
        if len(members) == n and all(o is not None for o in outs.values()) \
                and sum(outs.values()) == total:
            sizes = [outs[i] for i in range(n)]
        elif total % n == 0:
            sizes = [total // n] * n
        else:
            for m in members.values():
                unmatched[m] = f"cannot tell which rows of fused {path!r} belong to it"
                places.pop(m)
            continue
        starts = [sum(sizes[:i]) for i in range(n)]
        for i, m in members.items():
            places[m] = [_Place(path, rows=(starts[i], starts[i] + sizes[i]))]


def _onto_live_fused(places: dict[str, list[_Place]], names: ModelNames,
                     unmatched: dict[str, str]) -> None:
    """Give each place on a split layer of a fused module its rows of the fused layer too.

    The split layer keeps its place: the forward reads one of the two, and which one the flag
    does not always tell (diffusers' ``UNet2DConditionModel.unfuse_qkv_projections`` restores
    the split processors but leaves ``fused_projections`` and ``to_qkv``; a later unfuse of a
    merged model reads the split layers again). Updating both is right either way.
    """
    if not names.fused:
        return
    for module, module_places in list(places.items()):
        both = []
        for place in module_places:
            both.append(place)
            live = live_fused(place.path, names)
            if isinstance(live, str):
                unmatched[module] = live
                del places[module]
                break
            if live is not None:
                path, start, height = live
                a, b = place.rows or (0, height)
                both.append(dataclasses.replace(place, path=path, fused=None,
                                                rows=(start + a, start + b)))
        else:
            places[module] = both


def _out_rows(lora: LoRA, module: str) -> int | None:
    return next((p.out_rows for p in lora.modules[module] if p.param == "weight"), None)


def _check_rows(targets: list[Target], names: ModelNames) -> None:
    """Each row range lies within its parameter: checked before overlaps, which a range past
    the end would otherwise be reported as.
    """
    for t in targets:
        if t.rows is None:
            continue
        (start, end), shape = t.rows, names.shapes[t.param]
        rows = shape[0] if len(shape) else 0
        if not 0 <= start < end <= rows:
            where = (f"past the tensor's {rows} rows" if 0 <= start < end else
                     "an empty or reversed range (start must be >= 0 and below end)")
            raise ShapeMismatchError(
                f"adapter key {t.module_key!r} is sent to rows {start}:{end} of {t.param!r}: "
                f"{where}. Fix the row range that sends it there (mapping={{key: (path, "
                f"(start, end))}}); the rows of {t.param!r} are 0:{rows}."
            )


def _check_duplicates(targets: list[Target]) -> None:
    by_param: dict[str, list[Target]] = defaultdict(list)
    for t in targets:
        by_param[t.param].append(t)
    for param, ts in by_param.items():
        if len({t.module_key for t in ts}) < 2:
            continue
        spans = sorted(((t.rows or (0, 1 << 62)), t.module_key) for t in ts)
        for (a, ka), (b, kb) in zip(spans, spans[1:], strict=False):
            if ka != kb and b[0] < a[1]:
                raise DuplicateTargetError(
                    f"adapter keys {ka!r} and {kb!r} both update parameter {param!r}"
                    f"{'' if a == b == (0, 1 << 62) else ' on overlapping rows'}. Remove one "
                    "from the adapter, or pass mapping={...} to send one elsewhere."
                )
