"""Write a model folder again in the dtypes the model computes in, one tensor in memory at once.

A float32 release loaded in bfloat16 (``torch_dtype=torch.bfloat16``) is converted while read:
no tensor of it can be read again from its file as the model holds it, so under a host ceiling
every one stays in host memory (the refusals say so). :func:`cast` writes the folder once in the
dtypes the model is built with (``torch_dtype``, and float32 where its library keeps a module
in float32), file by file and tensor by tensor, so a machine whose RAM cannot hold the model
can still do it. Loading the copy gives the model loading the original gives, bit for bit
(each tensor rounded once, as the load rounds it), and its blocks stream from disk.

File and tensor names stay, so indexes stay valid (their ``total_size`` is written anew);
every other file is copied as it is (symlinks followed, as in a Hugging Face cache snapshot).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from itertools import chain
from pathlib import Path

import torch
from tqdm.auto import tqdm

from shuttle.errors import AdapterFileError, InvalidOptionError, ShuttleError
from shuttle.formats.safetensors_file import LazyTensor, SafetensorsFile
from shuttle.formats.safetensors_writer import SafetensorsWriter, staged_folder
from shuttle.integrations.pretrained import local_folder, weights_dtype
from shuttle.weights.lossless_file import LOSSLESS_KEY

__all__ = ["CastReport", "cast", "cast_folder", "model_dtypes"]

# (a weight file's path relative to the folder, as posix; a tensor's key) -> its new dtype
Plan = Mapping[tuple[str, str], torch.dtype]


@dataclasses.dataclass(frozen=True)
class CastReport:
    """What :func:`cast` wrote: ``out``, its weight files, the tensors whose dtype changed of
    all tensors, and the bytes of tensor data before and after.
    """

    out: Path
    files: int
    cast: int
    tensors: int
    bytes_before: int
    bytes_after: int


def cast(path_or_repo: str | os.PathLike[str], out: str | os.PathLike[str],
         torch_dtype: torch.dtype | str = torch.bfloat16, *, revision: str | None = None,
         overwrite: bool = False, progress: bool = True) -> CastReport:
    """Write the model folder ``path_or_repo`` to ``out`` with each weight in the dtype the
    model is built with at ``torch_dtype`` (see the module docstring).

    A diffusers pipeline folder (``model_index.json``: each model component built as
    :func:`shuttle.integrations.diffusers.from_pretrained` builds it) or a transformers model
    folder (``config.json``); tensors no module takes keep their dtype, as do integer ones.

    Args:
        path_or_repo: a folder, or ``owner/name`` on the Hugging Face Hub.
        out: the folder to write (must not exist, unless ``overwrite``); it appears complete
            or not at all.
        torch_dtype: the dtype the copy will be loaded in (a floating-point dtype or its name).
        revision: the Hub revision.
        overwrite: replace ``out`` if it exists.
        progress: a progress bar per weight file.

    Raises:
        AdapterFileError: not a pipeline or model folder, ``out`` exists (without
            ``overwrite``), is a file, or lies inside the source.
        ShuttleError: a weight file coded by ``shuttle compress`` (cast the folder it was made
            from, then compress the copy).
        InvalidOptionError: a ``torch_dtype`` that is not a floating-point dtype (or None).
        Whatever building the model on ``meta`` raises (a class the installed library lacks, a
        checkpoint that does not match it).
    """
    dtype = weights_dtype(torch_dtype)
    if dtype is None:
        raise InvalidOptionError("torch_dtype=None: name the dtype the copy will be loaded in "
                                 "(torch.bfloat16, 'float16', ...)")
    folder = local_folder(path_or_repo, revision, ["*"])
    return cast_folder(folder, out, model_dtypes(folder, dtype), overwrite=overwrite,
                       progress=progress)


def model_dtypes(folder: Path, torch_dtype: torch.dtype) -> dict[tuple[str, str], torch.dtype]:
    """Each weight file tensor of the pipeline or model ``folder`` that feeds a parameter or
    buffer -> that tensor's dtype in the model built on ``meta`` at ``torch_dtype``.
    """
    if (folder / "model_index.json").is_file():
        from shuttle.integrations.diffusers import empty_components

        built = empty_components(folder, torch_dtype)
    elif (folder / "config.json").is_file():
        from shuttle.integrations.transformers import empty_model

        built = [empty_model(folder, None, torch_dtype)]
    else:
        raise AdapterFileError(f"{folder}: neither a diffusers pipeline (model_index.json) nor "
                               "a transformers model (config.json); pass the folder "
                               "save_pretrained wrote")
    plan: dict[tuple[str, str], torch.dtype] = {}
    for model, sources in built:
        for name, t in chain(model.named_parameters(), model.named_buffers()):
            src = sources.get(name)
            if isinstance(src, LazyTensor):
                plan.setdefault((src.path.relative_to(folder).as_posix(), src.key), t.dtype)
    return plan


def cast_folder(source: str | os.PathLike[str], out: str | os.PathLike[str], plan: Plan, *,
                overwrite: bool = False, progress: bool = True) -> CastReport:
    """Write the folder ``source`` to ``out``, each ``.safetensors`` tensor the ``plan`` names
    converted to its dtype (one tensor in memory at a time), every other file copied.

    Raises:
        AdapterFileError: see :func:`cast`.
        ShuttleError: a weight file coded by ``shuttle compress``.
    """
    src, out = Path(source), Path(out)
    if not src.is_dir():
        raise AdapterFileError(f"{src} is not a folder; pass a model or pipeline folder")
    files = sorted(p for p in src.rglob("*") if p.is_file())
    weights = [p for p in files if p.suffix == ".safetensors"]
    for p in weights:
        if LOSSLESS_KEY in SafetensorsFile(p).metadata:
            raise ShuttleError(f"{p} was written by `shuttle compress`; cast the folder it was "
                               "made from, then compress the copy")
    counts = [0, 0, 0, 0]  # tensors cast, tensors, bytes before, bytes after
    written: dict[str, int] = {}  # a weight file (relative) -> its tensor bytes now
    with staged_folder(src, out, overwrite) as part:
        for f in files:
            rel = f.relative_to(src).as_posix()
            dest = part / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if f.suffix == ".safetensors":
                file_plan = {key: dtype for (name, key), dtype in plan.items() if name == rel}
                written[rel] = _cast_file(f, dest, file_plan, counts, progress)
            elif not f.name.endswith(".safetensors.index.json"):
                shutil.copyfile(f, dest)
        for f in files:  # indexes last: their sizes are the written files'
            if f.name.endswith(".safetensors.index.json"):
                _write_index(f, part / f.relative_to(src), written,
                             f.parent.relative_to(src))
    return CastReport(out, len(weights), *counts)


def _cast_file(source: Path, dest: Path, plan: Mapping[str, torch.dtype], counts: list[int],
               progress: bool) -> int:
    """Write one weight file with the tensors ``plan`` names in its dtypes (floating-point
    tensors only); its bytes of tensor data.
    """
    f = SafetensorsFile(source)
    refs = {k: f.tensor_ref(k) for k in f}
    dtypes = {k: plan[k] if k in plan and ref.dtype.is_floating_point
              and plan[k].is_floating_point else ref.dtype for k, ref in refs.items()}
    entries = {k: (dtypes[k], list(refs[k].shape)) for k in refs}
    total = sum(r.nbytes for r in refs.values())
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
              desc=f"casting {source.name}") as bar, \
            SafetensorsWriter(dest, entries, f.metadata) as writer:
        for name in writer.order:
            ref = refs[name]
            writer.write(name, ref.load().to(dtypes[name]))  # one tensor in memory
            bar.update(ref.nbytes)
    counts[0] += sum(dtypes[k] != r.dtype for k, r in refs.items())
    counts[1] += len(refs)
    counts[2] += total
    counts[3] += writer.nbytes
    return writer.nbytes


def _write_index(source: Path, dest: Path, written: Mapping[str, int], where: Path) -> None:
    """Copy an index, its ``metadata.total_size`` the bytes of the shards it names as
    written.
    """
    index = json.loads(source.read_text())
    meta = index.get("metadata")
    if isinstance(meta, dict) and "total_size" in meta:
        shards: Iterable[str] = set(index.get("weight_map", {}).values())
        meta["total_size"] = sum(written.get((where / s).as_posix(), 0) for s in shards)
    dest.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
