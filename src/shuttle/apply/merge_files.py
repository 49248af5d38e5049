"""File-to-file merges: a checkpoint and adapters in, a merged checkpoint out, one tensor at a time.

The merge is planned from the headers alone (the base checkpoint's and the adapters'), so every
input error (missing file, bad strength, shape, duplicate target, dtype or rounding) is raised
before a byte is written. Then each base tensor is read, merged exactly as
:func:`~shuttle.merge_lora` merges a parameter (the contributions applied in float32, rounded
once, here to the output dtype) and streamed into its shard; memory holds one tensor at a time.
Shards are written under temporary names next to the output (``.shuttle-partial.<name>...``, as
every temporary file shuttle writes, so ``remove_stale_temps`` finds one a killed run left) and
renamed only when all are complete, so a failure (a non-finite result, a full disk, Ctrl-C)
never replaces a good output.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from shuttle.apply.checks import check_finite
from shuttle.apply.notes import Note, plan_notes
from shuttle.apply.param_merge import apply_contributions, compute_dtype
from shuttle.apply.plan import (
    AdapterList,
    Contribution,
    MergePlan,
    ParamSpec,
    plan_params,
)
from shuttle.apply.rounding import Rounding, check_rounding, round_to
from shuttle.errors import (
    AdapterFileError,
    NonFiniteAdapterError,
    ShuttleError,
    UnmatchedKeysError,
)
from shuttle.formats.json_text import load_json
from shuttle.formats.model_checkpoint import Checkpoint, open_checkpoint, refuse_overwrite
from shuttle.formats.safetensors_file import LazyTensor
from shuttle.formats.safetensors_writer import SafetensorsWriter, create_temp
from shuttle.targets import KeyMapping
from shuttle.version import __version__

__all__ = ["OUTPUT_DTYPES", "FileMergeReport", "merge_files"]

log = logging.getLogger("shuttle")

OUTPUT_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8_e4m3fn": torch.float8_e4m3fn,
}
_LONG_NAMES = {str(d).removeprefix("torch."): d for d in OUTPUT_DTYPES.values()}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

BaseSource = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@dataclasses.dataclass
class FileMergeReport:
    """What :func:`merge_files` wrote.

    Attributes:
        files: the safetensors files written (one, or the shards in order).
        index: the ``*.safetensors.index.json`` written with several shards, else None.
        applied: names of the tensors the adapters changed, in checkpoint order.
        unmatched: adapter keys that reached no tensor -> why (``source::`` prefixed when
            several adapters were merged).
        skipped: adapter keys that were not turned into patches -> why.
        total_size: bytes of tensor data written.
        metadata: the ``__metadata__`` written into every file.
        notes: where the update differs on purpose from a peer tool's, as in
            :class:`~shuttle.MergeReport`.
    """

    files: list[Path]
    index: Path | None
    applied: list[str]
    unmatched: dict[str, str]
    skipped: dict[str, str]
    total_size: int
    metadata: dict[str, str]
    notes: list[Note] = dataclasses.field(default_factory=list)


def merge_files(
    base: BaseSource,
    loras: AdapterList,
    out: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    rounding: Rounding | None = None,
    seed: int | None = None,
    max_shard_bytes: int = 5 * 2**30,
    mapping: KeyMapping | None = None,
    progress: bool | None = None,
    strict: bool = False,
    allow_empty: bool = True,
) -> FileMergeReport:
    """Merge adapters into a safetensors checkpoint, writing a new checkpoint.

    The result equals loading ``base`` into a model, :func:`~shuttle.merge_lora` and saving its
    state dict, bit for bit (with ``dtype``: the float32 result rounded once to ``dtype``).

    Args:
        base: a ``.safetensors`` file, a list of them (shards), or a ``*.safetensors.index.json``.
        loras: ``[(lora, strength), ...]``, as for :func:`~shuttle.merge_lora`; the tensor names
            of ``base`` play the model's parameter names.
        out: a ``.safetensors`` path (several shards become ``NAME-00001-of-0000N.safetensors``
            beside it, with ``NAME.safetensors.index.json``), or a directory (files named
            ``model*.safetensors`` in it).
        dtype: output dtype of every floating-point tensor: ``"bf16"``, ``"fp16"``, ``"fp32"``,
            ``"fp8_e4m3fn"`` (or the torch dtype); None keeps each tensor's own. Other tensors
            are copied as they are.
        rounding: ``"nearest"`` or ``"stochastic"`` (seeded by tensor name and ``seed``);
            None (the default) as :func:`~shuttle.merge_lora`: nearest into 16/32/64-bit
            floats, stochastic into float8.
        seed: mixed into the stochastic rounding seed.
        max_shard_bytes: most tensor bytes per file; a larger single tensor gets its own file.
        mapping: adapter module key -> tensor path, as for :func:`~shuttle.merge_lora`.
        progress: show a progress bar (default: when writing to a terminal).
        strict: every adapter key must reach a tensor, else
            :class:`~shuttle.errors.UnmatchedKeysError` before anything is written.
        allow_empty: with False, adapters of which no key reaches a tensor raise
            :class:`~shuttle.errors.UnmatchedKeysError` before anything is written (``shuttle
            merge`` does this); with True (the default) that is logged as a warning and warned
            (:class:`UserWarning`), and the output is the base (in ``dtype``).

    Returns:
        A :class:`FileMergeReport`.

    Raises:
        AdapterFileError: a base or adapter file is missing, or ``base`` is not safetensors.
        CorruptFileError: a file is truncated, or the index names tensors its files lack.
        InvalidStrengthError: a bad strength.
        InvalidOptionError: an unknown ``rounding``.
        ShapeMismatchError, DuplicateTargetError, UnsupportedLayerError: as for a merge.
        UnmatchedKeysError: with ``strict``, an adapter key reaches no tensor; without
            ``allow_empty``, adapters were given and none of their keys reaches a tensor.
        OutputIsInputError: an output file (a shard, the index) is the base or an adapter
            file, or another name of one.
        ShuttleError: an unknown ``dtype``, a bad ``max_shard_bytes`` or ``out``.
            All of the above are raised before anything is written.
        NonFiniteAdapterError: while writing (each adapter tensor is read when its base
            tensor is merged): an adapter tensor holds NaN or infinity, or a tensor merges to
            values outside the range of the output dtype. The output is then left as it was
            (it is replaced only whole, so no earlier tensor is kept).
    """
    out_dtype = _parse_dtype(dtype)
    rounding = check_rounding(rounding)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) \
            or max_shard_bytes <= 0:
        raise ShuttleError(f"max_shard_bytes={max_shard_bytes!r}: pass a positive number of bytes")
    ckpt = _open_base(base)
    tensors: dict[str, LazyTensor] = ckpt.tensors  # type: ignore[assignment]  # files: all lazy
    plan = plan_params({n: ParamSpec(t.shape, t.dtype) for n, t in tensors.items()}, loras, mapping,
                       load=False, strict=strict)
    if not allow_empty and plan.adapters and not plan.params:
        raise UnmatchedKeysError(
            f"no adapter key reached a tensor of {ckpt.files[0]}: none of the "
            f"{len(plan.unmatched)} key(s) matched, so the output would be a copy of the base. "
            "The adapter was probably made for another model (or needs a mapping). Nothing "
            "was written.", plan.unmatched)
    dtypes = {n: out_dtype if out_dtype is not None and t.dtype.is_floating_point else t.dtype
              for n, t in tensors.items()}
    shards = _shards(tensors, dtypes, max_shard_bytes)
    paths, index = _output_paths(Path(out), len(shards))
    inputs = [*ckpt.files, *_index_naming(index, ckpt.files), *_adapter_files(loras)]
    refuse_overwrite([*paths, *([index] if index else [])], inputs)
    metadata = _metadata(ckpt.metadata, plan, out_dtype, rounding, seed)

    paths[0].parent.mkdir(parents=True, exist_ok=True)
    temps: list[Path] = []
    weight_map: dict[str, str] = {}
    total = sum(_nbytes(tensors[n].shape, dtypes[n]) for n in tensors)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="merging",
               disable=None if progress is None else not progress)
    try:
        for names, path in zip(shards, paths, strict=True):
            temps.append(create_temp(path))  # .shuttle-partial.<name>...: remove_stale_temps
            entries = {n: (dtypes[n], tensors[n].shape) for n in names}
            with SafetensorsWriter(temps[-1], entries, metadata) as writer:
                for name in writer.order:
                    value = _merged(tensors[name], name, plan.params.get(name, []),
                                    dtypes[name], rounding, seed)
                    writer.write(name, value)
                    weight_map[name] = path.name
                    bar.update(_nbytes(value.shape, value.dtype))
        if index is not None:
            temps.append(create_temp(index))
            ordered = {n: weight_map[n] for n in tensors}  # checkpoint order, not write order
            temps[-1].write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": ordered}, indent=2) + "\n")
        # Every file is complete: publish them, the index last (readers follow the index).
        for tmp, final in zip(temps, [*paths, *([index] if index else [])], strict=True):
            os.replace(tmp, final)
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    _warn_stale(paths, index, inputs)
    applied = [n for n in tensors if n in plan.params]
    return FileMergeReport(paths, index, applied, plan.unmatched, plan.skipped, total, metadata,
                           plan_notes(plan))


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        found = dtype if dtype in OUTPUT_DTYPES.values() else None
    else:
        found = OUTPUT_DTYPES.get(dtype) or _LONG_NAMES.get(dtype)
    if found is None:
        raise ShuttleError(
            f"dtype={dtype!r}: pass one of {', '.join(OUTPUT_DTYPES)} (or None to keep each "
            "tensor's dtype)"
        )
    return found


def _open_base(base: BaseSource) -> Checkpoint:
    """The base's headers: tensor name -> lazy tensor in checkpoint order, metadata, files."""
    if isinstance(base, Mapping):
        raise AdapterFileError("base must be checkpoint files (.safetensors, shards or an "
                               "index.json); to merge a state dict, load it and use merge_lora")
    return open_checkpoint(base)


def _adapter_files(loras: AdapterList) -> list[Path]:
    """The files that adapters given by path are read from (a directory: the files in it)."""
    entries = [] if not isinstance(loras, Sequence) else [e[0] for e in loras
                                                          if isinstance(e, tuple) and e]
    paths = [Path(p) for e in entries
             for p in (e if isinstance(e, (list, tuple)) else [e])
             if isinstance(p, (str, os.PathLike))]
    return [f for p in paths for f in (sorted(p.iterdir()) if p.is_dir() else [p])]


def _index_naming(index: Path | None, files: Sequence[Path]) -> list[Path]:
    """``[index]`` when that file exists and names one of the input ``files`` (the base was
    given as its shards): it is the inputs' own index, which the output's would replace.
    """
    if index is None or not index.is_file():
        return []
    try:
        named = {(index.parent / v).resolve()
                 for v in load_json(index.read_bytes())["weight_map"].values()}
    except (ValueError, OSError, LookupError, TypeError, AttributeError):
        return []  # no index of a checkpoint: not one of the inputs
    return [index] if named & {Path(f).resolve() for f in files} else []


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _shards(tensors: Mapping[str, LazyTensor], dtypes: Mapping[str, torch.dtype],
            max_bytes: int) -> list[list[str]]:
    """Tensor names split greedily in checkpoint order into files of at most ``max_bytes``."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = _nbytes(t.shape, dtypes[name])
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


# Suffixes of other checkpoint formats: an output named so would be taken for a directory.
_OTHER_FORMATS = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".sft")


def _output_paths(out: Path, n: int) -> tuple[list[Path], Path | None]:
    """The final file names for ``n`` shards, and the index path when ``n > 1``."""
    if out.suffix == ".safetensors":
        if out.is_dir():
            raise ShuttleError(f"out={out} is a directory; pass a file name or the directory")
        directory, stem = out.parent, out.name.removesuffix(".safetensors")
    else:
        if out.suffix.lower() in _OTHER_FORMATS and not out.is_dir():
            raise ShuttleError(
                f"out={out}: merged checkpoints are written as safetensors only; name the "
                f"output {out.with_suffix('.safetensors').name}, or pass a directory"
            )
        if out.exists() and not out.is_dir():
            raise ShuttleError(
                f"out={out} is a file without the .safetensors suffix; name the output "
                "NAME.safetensors, or pass a directory"
            )
        directory, stem = out, "model"
    if n == 1:
        return [directory / f"{stem}.safetensors"], None
    return ([directory / f"{stem}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)],
            directory / f"{stem}.safetensors.index.json")


def _metadata(base: Mapping[str, str], plan: MergePlan, dtype: torch.dtype | None,
              rounding: Rounding | None, seed: int | None) -> dict[str, str]:

    meta = dict(base)
    meta.setdefault("format", "pt")  # transformers refuses safetensors metadata without it
    meta["shuttle.version"] = __version__
    meta["shuttle.adapters"] = json.dumps(
        [{"source": lora.source, "format": lora.format,
          "strength": plan.components.get(i, s)} for i, (lora, s) in enumerate(plan.adapters)])
    meta["shuttle.rounding"] = rounding or "default"  # nearest, float8 stochastic
    meta["shuttle.dtype"] = str(dtype).removeprefix("torch.") if dtype else "unchanged"
    if seed is not None:
        meta["shuttle.seed"] = str(seed)
    return meta


def _merged(t: LazyTensor, name: str, contribs: list[Contribution], dtype: torch.dtype,
            rounding: Rounding | None, seed: int | None) -> torch.Tensor:
    """Base tensor ``t`` with its contributions, rounded once to ``dtype``.

    At most one pass checks the result: none for a tensor copied as it is or converted to a
    dtype that holds every value of its own; one (``aminmax``, of the result or for float8 of
    the unrounded sum) otherwise, and only when it finds something a slower pass says where.
    """
    # A copy, not a view of the file's map: touched map pages stay resident until the file is
    # closed, so a view would grow the process to the checkpoint's size; a copy is freed here.
    value = t.load(copy=True)
    if not contribs and dtype == value.dtype:
        return value  # untouched: the file's bytes as they are
    if not contribs:
        w = value if value.dtype in (torch.float32, torch.float64) else value.float()
        out = round_to(w, dtype, rounding, name, seed)
        if not _fits(value.dtype, dtype):
            _check_range(value, w, out, name, dtype, merged=False)
        return out
    # Read the patches now, not at planning: one tensor's adapters in memory at a time. Found
    # finite here (a NaN adapter is reported as such), a non-finite sum below is an overflow
    # of the compute dtype or the weight's own NaN or infinity.
    contribs = [dataclasses.replace(c, patch=c.patch.load("cpu")) for c in contribs]
    check_finite(MergePlan({name: contribs}, {}, {}))
    compute = compute_dtype(value.dtype if value.dtype == torch.float64 else dtype, contribs)
    # merge_lora's own per-parameter math (its CPU path): contributions applied in float32 (or
    # float64), then the one rounding, round_to below, seeded exactly as merge_lora's.
    w = apply_contributions(value.to(compute, copy=True), contribs)
    out = round_to(w, dtype, rounding, name, seed, contribs)
    _check_range(value, w, out, name, dtype, merged=True)
    return out


def _fits(have: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether every finite value of ``have`` rounds to a finite value of ``dtype`` (to nearest
    or stochastically: both neighbours of a value are at most ``dtype``'s largest).
    """
    return have.is_floating_point and torch.finfo(dtype).max >= torch.finfo(have).max


def _check_range(value: torch.Tensor, w: torch.Tensor, out: torch.Tensor, name: str,
                 dtype: torch.dtype, *, merged: bool) -> None:
    """Raise if a value that was finite in the base is lost in ``out``: infinite after the
    merge in the compute dtype (``w``), or beyond ``dtype``'s range (float16 rounds it to
    infinity, float8 saturates silently). NaN and infinity already in the base pass through.
    """
    fi = torch.finfo(dtype)
    limit = fi.max + 2.0 ** math.floor(math.log2(fi.max)) * fi.eps / 2  # max + half an ulp
    if w.numel() == 0:
        return
    if dtype in _FP8:  # no isfinite for float8: the sum against the saturation limit
        lo, hi = torch.aminmax(w)
        if math.isfinite(lo) and math.isfinite(hi) and max(-float(lo), float(hi)) < limit:
            return
    else:  # one pass over the result; stochastic rounding may step from near max to inf
        lo, hi = torch.aminmax(out)
        if math.isfinite(lo) and math.isfinite(hi):
            return
    # Rare: where exactly (the base's own NaN and infinity are not this merge's doing).
    was_finite = torch.isfinite(value if value.element_size() > 1 else value.float())
    lost = ~torch.isfinite(w) | (w.abs() >= limit)
    if dtype not in _FP8:
        lost |= ~torch.isfinite(out)
    bad = was_finite & lost
    if not bool(bad.any()):
        return
    finite = torch.isfinite(w)
    largest = float(w[finite].abs().max()) if bool(finite.any()) else math.inf
    where = "" if largest < limit else f" (largest |value| {largest:.4g}, limit {fi.max:.4g})"
    raise NonFiniteAdapterError(
        f"tensor {name!r} {'merges to' if merged else 'holds'} values beyond the range of "
        f"{dtype if bool((bad & finite).any()) else w.dtype}{where}; "
        f"{'lower the strength or ' if merged else ''}choose a wider output dtype "
        "(bf16/fp32). Nothing was written: the output is replaced only when every tensor is "
        "complete, and no earlier tensor is kept."
    )


def _warn_stale(paths: list[Path], index: Path | None, inputs: list[Path]) -> None:
    """Warn about files of an earlier merge to the same name that this one did not replace
    (never the inputs: the user would be told to delete them).
    """
    first = paths[0]
    stem = first.name.removesuffix(".safetensors").rsplit("-00001-of-", 1)[0]
    read = {p.resolve() for p in inputs}
    stale = sorted(p.name for p in first.parent.glob(f"{stem}-*-of-*.safetensors")
                   if p not in paths and p.resolve() not in read)
    old_index = first.parent / f"{stem}.safetensors.index.json"
    if index is None and old_index.exists() and old_index.resolve() not in read \
            and not _index_naming(old_index, inputs):
        stale.insert(0, old_index.name)  # first: loaders that find an index follow it
    if stale:
        log.warning("%s holds %d file(s) of an earlier output that this merge did not replace "
                    "(%s); delete them so loaders do not mix them in", first.parent, len(stale),
                    ", ".join(stale[:5]) + (", ..." if len(stale) > 5 else ""))
