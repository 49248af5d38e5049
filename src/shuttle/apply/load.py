"""Load a checkpoint into a model one tensor at a time, with adapters merged on the way in.

Each tensor is read from its file, moved to its device, given every adapter update of its
parameter in float32 and rounded once to its final dtype, and only then put in the model. This
is the one place a dense payload can land in a model built on the ``meta`` device (sharded or
not yet allocated): ``.set_weight`` supplies a parameter the checkpoint does not have, ``.diff``
and low-rank updates change one it does. Host memory stays at about the largest tensor (plus the
adapters' tensors), never the state dict. A file written by ``shuttle compress`` is read coded
and decoded where it lands (:mod:`shuttle.weights.lossless_file`), to the original bits. Into
a sharded model (DTensor parameters) a rank reads a row-sharded tensor that no adapter changes
by its rows alone.

Everything that can fail because of the input is checked from file headers before the first
tensor is written: files, strengths, shapes, duplicate targets, parameters nobody supplies, and
(by one read of the adapter tensors) NaN or infinity in an adapter.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm

from shuttle.apply.checks import check_finite
from shuttle.apply.fused_jobs import overflow_flag
from shuttle.apply.notes import Note, plan_notes
from shuttle.apply.param_merge import compute_dtype, exact_cublas, merge_param
from shuttle.apply.plan import (
    AdapterList,
    Contribution,
    MergePlan,
    ParamSpec,
    plan_params,
)
from shuttle.apply.rounding import Rounding, check_rounding, round_to
from shuttle.apply.sharded import agreed, merge_fingerprint
from shuttle.errors import (
    DuplicateTargetError,
    MissingParameterError,
    NonFiniteAdapterError,
    ShapeMismatchError,
    ShuttleError,
    UnsupportedLayerError,
)
from shuttle.formats import LoRA, load_lora
from shuttle.formats.device_reader import DeviceReader
from shuttle.formats.model_checkpoint import Checkpoint, CheckpointSource
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.formats.source import Source
from shuttle.patches import PATCH_KINDS
from shuttle.patches.patch import Tensorish, materialize
from shuttle.targets import KeyMapping, ModelNames, resolve, transposed_modules
from shuttle.weights.dtensor import ShardedWeight, sharded
from shuttle.weights.lossless_file import CodedRef, open_decoded

__all__ = ["LoadReport", "load_checkpoint", "replacement_parameters"]

log = logging.getLogger("shuttle")
_PROGRESS_MIN_TENSORS = 200


@dataclasses.dataclass
class LoadReport:
    """What a load did.

    Attributes:
        loaded: checkpoint keys read into the model (parameters and buffers), in reading order.
        supplied: parameters the checkpoint lacks that adapters supplied (``.set_weight``).
        patched: parameters that received adapter updates (loaded or supplied).
        unexpected: checkpoint keys the model has no tensor for (not read).
        unmatched: adapter keys that reached no parameter -> why (prefixed ``source::`` when
            several adapters were given), as in :class:`~shuttle.MergeReport`.
        dense_unmatched: the dense payloads (``diff``/``set``) among them, by the parameter they
            address (``<adapter module>.<param>``) -> kind and why; each is also logged.
        missing: parameters and buffers left as they were (only with ``strict=False``).
        skipped: adapter keys that ``load_lora`` did not turn into patches -> why.
        notes: where the update differs on purpose from a peer tool's, as in
            :class:`~shuttle.MergeReport`.
    """

    loaded: list[str]
    supplied: list[str]
    patched: list[str]
    unexpected: list[str]
    unmatched: dict[str, str]
    dense_unmatched: dict[str, str] = dataclasses.field(default_factory=dict)
    missing: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[Note] = dataclasses.field(default_factory=list)

    @property
    def applied(self) -> list[str]:
        """``patched``, by the name every adapter report uses (:class:`AdapterReport`)."""
        return self.patched


class _Slot(NamedTuple):
    """One tensor object of the model under every name it has (tied weights share a slot)."""

    names: list[str]
    homes: list[tuple[nn.Module, str]]  # (owning module, attribute) per name
    tensor: torch.Tensor
    is_param: bool
    shard: ShardedWeight | None = None  # a DTensor: this rank's shard of it


def load_checkpoint(
    model: nn.Module,
    files: CheckpointSource,
    loras: AdapterList = (),
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    mapping: KeyMapping | None = None,
    rounding: Rounding | None = None,
    seed: int | None = None,
    progress: bool | None = None,
    strict_adapters: bool = False,
) -> LoadReport:
    """Stream a safetensors checkpoint into ``model``, folding adapters in as tensors arrive.

    Args:
        model: the model; may be built on the ``meta`` device. Its parameters and persistent
            buffers are replaced (or, when already materialized with the final dtype and
            device, overwritten in place); tied parameters stay tied.
        files: a ``.safetensors`` file, a ``*.safetensors.index.json`` (sharded), a directory
            holding either, a list of these, or a state dict in memory.
        loras: ``[(lora, strength), ...]`` as for :func:`~shuttle.merge_lora`.
        device: where tensors land (default: each tensor's current device; CPU for ``meta``).
        dtype: the floating-point dtype tensors land in (default: each checkpoint tensor's own
            dtype, as ``load_state_dict(assign=True)``; for a supplied parameter, the model's).
            Integer and bool tensors keep theirs.
        strict: raise when a parameter or persistent buffer gets no value; with False it is
            left as it was and listed in ``LoadReport.missing``.
        mapping: adapter module key -> model module path, as for :func:`~shuttle.merge_lora`.
        rounding: ``"nearest"`` or ``"stochastic"`` (seeded by parameter name and ``seed``);
            None (the default) rounds as :func:`~shuttle.merge_lora` does: nearest into
            16/32/64-bit floats, stochastic into float8 and quantized weights.
        seed: mixed into the stochastic rounding seed.
        progress: a progress bar over tensors (default: with more than 200).
        strict_adapters: every adapter key must reach a parameter, else
            :class:`~shuttle.errors.UnmatchedKeysError` before the first tensor is read (the
            ``strict`` of :func:`~shuttle.merge_lora`; named apart because ``strict`` here is
            about the checkpoint's coverage of the model). Without it, adapters of which no key
            lands are logged as a warning and warned (:class:`UserWarning`).

    Returns:
        A :class:`LoadReport`.

    Raises:
        AdapterFileError, CorruptFileError: a checkpoint or adapter file is missing or corrupt.
        InvalidStrengthError: a strength is not a finite number.
        InvalidOptionError: ``rounding`` is unknown.
        ShapeMismatchError: a checkpoint tensor or an adapter update does not fit the model.
        DuplicateTargetError: two keys of one adapter, or two adapters' ``set_weight``, reach
            one parameter.
        MissingParameterError: a parameter is in neither the checkpoint nor an adapter (strict).
        NonFiniteAdapterError: an adapter tensor holds NaN or infinity.
        UnsupportedLayerError: an update targets an integer tensor, or the checkpoint's and the
            model's tensor disagree on being floating point.
        UnmatchedKeysError: with ``strict_adapters``, an adapter key reaches no parameter.
        All of these are raised before the first tensor is written. Only a merged value that
        overflows its dtype (float16 beyond 65504) is found when its tensor is reached, and
        raises ``NonFiniteAdapterError`` with earlier tensors already loaded.
    """
    rounding = check_rounding(rounding)
    if dtype is not None and not dtype.is_floating_point:
        raise ShuttleError(f"dtype={dtype}: pass a floating-point dtype, or None to keep the "
                           "checkpoint's dtypes")
    target = torch.device(device) if device is not None else None
    slots, alias = _slots(model)
    # A sharded model: every rank validates, and agrees on the adapters' merge, before any
    # rank writes (apply.sharded).
    ckpt, source, unexpected, specs, plan, supplied, missing, dense_unmatched = agreed(
        {n: s.tensor for n, s in slots.items()},
        lambda: _validate(files, slots, alias, loras, mapping, dtype, target, strict,
                          strict_adapters, transposed_modules(model)),
        lambda r: merge_fingerprint(r[4], rounding, seed))

    # The checkpoint's own order, file by file: reads go through each file front to back.
    reads = [(k, alias[k]) for k in ckpt.tensors if k in alias and source[alias[k]] == k]
    total = len(reads) + len(supplied)
    show = progress if progress is not None else total > _PROGRESS_MIN_TENSORS
    loaded = []
    staged = DeviceReader(target) if target is not None and target.type == "cuda" else None
    with torch.no_grad(), exact_cublas(), \
            tqdm(total=total, desc="loading", unit="tensor", disable=not show) as bar:
        for key, name in reads:
            slot = slots[name]
            contribs = plan.params.get(name, [])
            ref, dev = ckpt.tensors[key], _device(slot, target)
            final = _final_dtype(slot, ckpt, key, dtype)
            rows = _shard_rows(slot, ref, contribs)
            if rows is not None:  # a shard nothing merges into: its rows alone are read
                t = ref.load_rows(*rows).to(dev)
            elif staged is not None and isinstance(ref, LazyTensor) and dev == staged.device:
                t = staged.read(ref)  # pinned and double-buffered: no pageable copy
            elif isinstance(ref, CodedRef):
                t = ref.load(dev)  # the code crosses the bus; decoded where it lands
            else:
                t = _read(ref, bool(contribs)).to(dev)
            _install(slot, _land(t, final, name, contribs, rounding, seed),
                     row0=0 if rows is None else rows[0])
            loaded.append(key)
            bar.update()
        for name in supplied:
            spec = specs[name]
            base = torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)
            _install(slots[name], _land(base, spec.dtype, name, plan.params[name], rounding, seed))
            bar.update()
    return LoadReport(loaded, supplied, list(plan.params), unexpected, plan.unmatched,
                      dense_unmatched, [] if strict else missing, plan.skipped,
                      plan_notes(plan))



def _validate(files: CheckpointSource, slots: dict[str, _Slot], alias: dict[str, str],
              loras: AdapterList, mapping: KeyMapping | None, dtype: torch.dtype | None,
              target: torch.device | None, strict: bool, strict_adapters: bool,
              transposed: frozenset[str]) -> tuple:
    """Everything :func:`load_checkpoint` checks before its first write."""
    ckpt = open_decoded(files)

    # Which checkpoint key feeds which slot; a tied slot is read once, from its first key.
    source: dict[str, str] = {}
    unexpected = []
    for key in ckpt.tensors:
        if key not in alias:
            unexpected.append(key)
        else:
            source.setdefault(alias[key], key)
    _check_checkpoint(ckpt, slots, source)

    specs = {name: ParamSpec(s.tensor.shape, _final_dtype(s, ckpt, source.get(name), dtype),
                         _device(s, target))
             for name, s in slots.items() if s.is_param}
    plan = plan_params(specs, loras, mapping, load=False, strict=strict_adapters,
                       transposed=transposed)
    _check_sets(plan)
    supplied = [n for n, cs in plan.params.items()
                if n not in source and any(PATCH_KINDS[c.patch.kind].replaces and c.rows is None
                                           for c in cs)]
    missing = [n for n in slots if n not in source and n not in supplied]
    if missing and strict:
        raise MissingParameterError(
            f"{len(missing)} model tensor(s) are in neither the checkpoint nor an adapter's "
            f"set_weight: {', '.join(repr(n) for n in missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}. Load the checkpoint made for this model, add "
            "the adapter that supplies them, or pass strict=False to leave them as they are."
        )
    check_finite(plan)  # every adapter tensor read once before any write
    dense_unmatched = _report_dense(plan)
    _check_dtensors(slots)
    return ckpt, source, unexpected, specs, plan, supplied, missing, dense_unmatched


def _check_dtensors(slots: dict[str, _Slot]) -> None:
    """DTensor targets are written in place, shard by shard: they must be materialized, and
    their placements must have windows (raises before any rank writes).
    """
    for slot in slots.values():
        if slot.shard is not None:
            slot.shard.check_load()


def replacement_parameters(
    lora: LoRA | Source,
    model_or_names: nn.Module | Mapping[str, torch.Size | tuple[int, ...]] | Iterable[str],
    mapping: KeyMapping | None = None,
) -> frozenset[str]:
    """The model parameters an adapter supplies outright (its ``set_weight`` payloads).

    Reads no tensor (only file headers), so a caller can decide what a model needs before
    building or loading it: a parameter that only exists under one backend, say.

    Args:
        lora: the adapter, or anything :func:`~shuttle.load_lora` reads.
        model_or_names: a model (``meta`` is fine), parameter name -> shape, or names alone
            (then split projections cannot be given rows of a fused one; whole parameters,
            which is what ``set_weight`` supplies, resolve the same).
        mapping: adapter module key -> model module path, as for :func:`~shuttle.merge_lora`.

    Returns:
        The model's parameter names that a ``Set`` patch of the adapter replaces whole.

    Raises:
        AdapterFileError, CorruptFileError, AdapterFormatError: the adapter cannot be read.
        DuplicateTargetError: two of its keys reach one parameter.
    """
    if isinstance(model_or_names, nn.Module):
        names = ModelNames.of(model_or_names)
    elif isinstance(model_or_names, Mapping):
        names = ModelNames(model_or_names)
    else:
        names = ModelNames({n: torch.Size([0]) for n in model_or_names})  # shapes unknown
    res = resolve(load_lora(lora), names, mapping)
    return frozenset(t.param for t in res.targets
                     if PATCH_KINDS[t.patch.kind].replaces and t.rows is None)


# -- the model side --------------------------------------------------------------------------

def _slots(model: nn.Module) -> tuple[dict[str, _Slot], dict[str, str]]:
    """Parameters and persistent buffers by canonical name, and every name -> canonical name.

    The canonical name is the first one met, as ``model.named_parameters()`` lists it, so it is
    the name adapters are planned against.
    """
    by_id: dict[int, _Slot] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for is_param, table in ((True, module._parameters), (False, module._buffers)):
            for leaf, t in table.items():
                if t is None or (not is_param and leaf in module._non_persistent_buffers_set):
                    continue
                slot = by_id.setdefault(id(t), _Slot([], [], t, is_param))
                slot.names.append(f"{prefix}.{leaf}" if prefix else leaf)
                slot.homes.append((module, leaf))
    slots = {s.names[0]: s._replace(shard=sharded(s.tensor, s.names[0])) for s in by_id.values()}
    alias = {n: s.names[0] for s in by_id.values() for n in s.names}
    return slots, alias


def _device(slot: _Slot, target: torch.device | None) -> torch.device:
    if target is not None:
        return target
    if slot.shard is not None:  # where its shard lives (the whole tensor is cut there)
        return slot.shard.device
    return torch.device("cpu") if slot.tensor.is_meta else slot.tensor.device


def _final_dtype(slot: _Slot, ckpt: Checkpoint, key: str | None,
                 dtype: torch.dtype | None) -> torch.dtype:
    have = ckpt.tensors[key].dtype if key is not None else slot.tensor.dtype
    return dtype if dtype is not None and have.is_floating_point else have


def _shard_rows(slot: _Slot, ref: Tensorish, contribs: list[Contribution]
                ) -> tuple[int, int] | None:
    """The rows of the checkpoint tensor that this rank's shard of ``slot`` holds, where reading
    those rows alone is enough (a DTensor nothing merges into, read from a file, that is not
    replicated along its rows); else None (the whole tensor is read: merges are planned
    against it).
    """
    if contribs or not isinstance(ref, LazyTensor) or slot.shard is None:
        return None
    return slot.shard.read_rows()


def _install(slot: _Slot, t: torch.Tensor, row0: int = 0) -> None:
    """Put ``t`` in the model under every name of ``slot``: for a DTensor, this rank's window
    of ``t`` (which holds the tensor's rows from ``row0`` on), copied into its local shard in
    place (the whole tensor is then dropped, so a rank holds at most one whole tensor at a
    time).
    """
    if slot.shard is not None:
        slot.shard.write(t, row0)
        return
    old = slot.tensor
    if (not old.is_meta and old.dtype == t.dtype and old.device == t.device
            and old.shape == t.shape):
        # Materialized already: overwrite, keeping the object (optimizers, hooks and ties
        # that hold it stay valid), as load_state_dict does.
        old.copy_(t)
        return
    new = nn.Parameter(t, requires_grad=old.requires_grad) if slot.is_param else t
    for module, leaf in slot.homes:  # every alias gets the same new object: ties stay tied
        (module._parameters if slot.is_param else module._buffers)[leaf] = new


# -- checks before the first write ----------------------------------------------------------

def _check_checkpoint(ckpt: Checkpoint, slots: dict[str, _Slot], source: dict[str, str]) -> None:
    for name, key in source.items():
        e, t = ckpt.tensors[key], slots[name].tensor
        if e.shape != t.shape:
            raise ShapeMismatchError(
                f"checkpoint tensor {key!r} has shape {tuple(e.shape)} but the model's {name!r} "
                f"has shape {tuple(t.shape)}. Load the checkpoint made for this model (or "
                "build the model with the checkpoint's configuration)."
            )
        if e.dtype.is_floating_point != t.dtype.is_floating_point:
            raise UnsupportedLayerError(
                f"checkpoint tensor {key!r} is {e.dtype} but the model's {name!r} is {t.dtype}; "
                "one is floating point and the other not. Load the checkpoint made for this model."
            )


def _check_sets(plan: MergePlan) -> None:
    """Two adapters may not both supply (``set_weight``) the same rows of one parameter."""
    for name, contribs in plan.params.items():
        sets = sorted(((c.rows or (0, 1 << 62)), c.adapter) for c in contribs
                      if PATCH_KINDS[c.patch.kind].replaces)
        for (a, ia), (b, ib) in zip(sets, sets[1:], strict=False):
            if ia != ib and b[0] < a[1]:
                raise DuplicateTargetError(
                    f"adapters {plan.adapters[ia][0].source!r} and "
                    f"{plan.adapters[ib][0].source!r} both supply (set_weight) parameter "
                    f"{name!r}; which value should win is ambiguous. Pass only one of them."
                )


def _report_dense(plan: MergePlan) -> dict[str, str]:
    """Warn about each dense payload that reached no parameter; return them with why."""
    # Matched by (adapter, module key, parameter leaf), not by patch identity: a payload of a
    # fused module split by rows reaches its parameters as new (row-sliced) patch objects.
    placed = {(c.adapter, c.module_key, name.rsplit(".", 1)[-1])
              for name, cs in plan.params.items() for c in cs}
    tagged = len(plan.adapters) > 1
    out = {}
    for i, (lora, _) in enumerate(plan.adapters):
        tag = f"{lora.source}::" if tagged else ""
        for module, patch in lora.patches():
            if not PATCH_KINDS[patch.kind].payload or (i, module, patch.param) in placed:
                continue
            why = (plan.unmatched.get(f"{tag}{module}")
                   or plan.unmatched.get(f"{tag}{module} ({patch.param})")
                   or "it reached no parameter")
            target = f"{tag}{module}.{patch.param}"
            out[target] = f"{patch.kind} payload: {why}"
            log.warning("dense %s payload for %r was not loaded: %s", patch.kind, target, why)
    return out


# -- one tensor ------------------------------------------------------------------------------

def _read(ref: Tensorish, writable: bool) -> torch.Tensor:
    """The tensor in memory the caller may keep (and, with ``writable``, change in place)."""
    if isinstance(ref, LazyTensor):
        # Into memory of its own, not a view of the file's map: touched pages of a map stay
        # resident, so a map would grow the process to the checkpoint's size.
        return ref.load(copy=True)
    t = materialize(ref)
    return t.clone() if writable else t  # a caller's state dict is never changed


def _land(t: torch.Tensor, final: torch.dtype, name: str, contribs: list[Contribution],
          rounding: Rounding | None, seed: int | None) -> torch.Tensor:
    """``t`` (the checkpoint's value, on its device) with ``contribs`` applied, in ``final``.

    The updates are summed in float32 onto the checkpoint's own value and rounded once: casting
    to ``final`` first would round twice.
    """
    if not contribs:
        return t.to(final)
    loaded = [dataclasses.replace(c, patch=c.patch.load(t.device)) for c in contribs]
    try:
        if t.dtype == final:
            # in place, one rounding; the fused CUDA kernel flags an overflow instead of raising
            flag = overflow_flag(t, loaded, {})
            merge_param(t, name, loaded, rounding, seed, overflow=flag)
            if flag is not None and bool(flag):
                raise NonFiniteAdapterError(f"merging into {name!r} overflows {final}")
            return t
        wide = compute_dtype(torch.float64 if torch.float64 in (t.dtype, final) else final,
                             loaded)
        w = t.to(wide)
        merge_param(w, name, loaded)  # rounding to float32 is exact: nothing is lost here
        out = round_to(w, final, rounding, name, seed, loaded)
        if not bool(torch.isfinite(out).all()):
            raise NonFiniteAdapterError(f"merging into {name!r} overflows {final}")
        return out
    except NonFiniteAdapterError as e:
        raise NonFiniteAdapterError(
            f"merging the adapters into {name!r} gives NaN or infinity in {final} (the update "
            "overflows it). Loading stopped there: tensors before it in the checkpoint are "
            "loaded, the rest are not. Lower the strength, or load in a wider dtype."
        ) from e
