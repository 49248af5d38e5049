"""Open a model checkpoint by its headers: one safetensors file, shards, an index, or a dict.

Sources: a ``.safetensors`` file; a ``*.safetensors.index.json`` (Hugging Face sharded
checkpoints: ``{"weight_map": {name: shard file}}``, shards next to the index); a directory
holding one index, or else its ``*.safetensors`` files; a list of any of these (their tensors
together); or an in-memory state dict. Only headers are read: each tensor is a
:class:`~shuttle.formats.safetensors_file.LazyTensor` until asked for.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from shuttle.errors import (
    AdapterFileError,
    CheckpointError,
    CorruptFileError,
    OutputIsInputError,
)
from shuttle.formats.json_text import load_json
from shuttle.formats.safetensors_file import SafetensorsFile
from shuttle.formats.source import tensor_dict
from shuttle.patches.patch import Tensorish

__all__ = ["Checkpoint", "CheckpointSource", "open_checkpoint", "refuse_overwrite"]

CheckpointSource = (
    str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Mapping[str, torch.Tensor]
)


@dataclasses.dataclass
class Checkpoint:
    """What :func:`open_checkpoint` found.

    Attributes:
        name: a description for messages and metadata (file names, or ``"<state dict>"``).
        tensors: parameter name -> tensor or lazy reference, in file order.
        metadata: the files' safetensors ``__metadata__``, merged.
        files: every file read (shards and indexes); empty for a state dict.
    """

    name: str
    tensors: dict[str, Tensorish]
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    files: list[Path] = dataclasses.field(default_factory=list)


def open_checkpoint(source: CheckpointSource) -> Checkpoint:
    """Open ``source`` reading headers only.

    Args:
        source: see the module docstring.

    Returns:
        A :class:`Checkpoint`.

    Raises:
        AdapterFileError: a path does not exist, a directory holds no checkpoint, or a file is
            neither ``.safetensors`` nor an index.
        CorruptFileError: a file's header is inconsistent, or an index names a tensor its shard
            lacks.
        CheckpointError: a tensor appears in two files, or a state dict holds non-tensors.
    """
    if isinstance(source, Mapping):
        return Checkpoint("<state dict>", tensor_dict(source, CheckpointError))
    paths = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not paths:
        raise AdapterFileError("an empty list of checkpoint files was given; pass at least one")
    tensors: dict[str, Tensorish] = {}
    metadata: dict[str, str] = {}
    names = []
    files: list[Path] = []
    for path in map(Path, paths):
        part, meta, read = _open_path(path)
        names.append(path.name)
        files.extend(read)
        metadata.update(meta)
        for k in part:
            if k in tensors:
                raise CheckpointError(
                    f"tensor {k!r} appears in more than one of {[str(p) for p in paths]}; pass "
                    "the files of one checkpoint, each once."
                )
        tensors.update(part)
    return Checkpoint(", ".join(names), tensors, metadata, files)


def refuse_overwrite(outputs: Iterable[Path], inputs: Iterable[str | os.PathLike[str]],
                     what: str = "out") -> None:
    """Raise before anything is written when an output would replace an input file.

    An output replaces an input when it names the same file after resolving symlinks, or is
    another name (a hard link) of the same inode; ``outputs`` should list every file a command
    will write (each shard and the index), so a shard of a sharded input is caught too.

    Raises:
        OutputIsInputError: the first output that is an input.
    """
    ins = [Path(p) for p in inputs]
    resolved = {p.resolve(): p for p in ins}
    for out in outputs:
        hit = resolved.get(out.resolve())
        if hit is None and out.exists():
            hit = next((p for p in ins if p.exists() and os.path.samefile(p, out)), None)
        if hit is not None:
            raise OutputIsInputError(
                f"{what}={str(out)!r} would overwrite the input {str(hit)!r}; write the output "
                "to another file or directory (nothing was written)."
            )


def _open_path(path: Path) -> tuple[dict[str, Tensorish], dict[str, str], list[Path]]:
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise AdapterFileError(
                f"{path}: holds several indexes ({', '.join(p.name for p in indexes)}); pass the "
                "one to use."
            )
        if indexes:
            return _open_index(indexes[0])
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise AdapterFileError(
                f"{path}: a directory with no *.safetensors file or index; pass the checkpoint "
                "file itself."
            )
        ckpt = open_checkpoint(files)
        return ckpt.tensors, ckpt.metadata, ckpt.files
    if path.name.endswith(".json"):
        return _open_index(path)
    if path.suffix != ".safetensors":
        if not path.exists():
            raise AdapterFileError(f"{path}: no such file or directory")
        raise AdapterFileError(
            f"{path}: checkpoints are read as .safetensors (or a .safetensors.index.json); "
            "convert this file to safetensors first."
        )
    f = SafetensorsFile(path)
    return {k: f.tensor_ref(k) for k in f}, f.metadata, [path]


def _open_index(path: Path) -> tuple[dict[str, Tensorish], dict[str, str], list[Path]]:
    if not path.is_file():
        raise AdapterFileError(f"{path}: no such file")
    try:
        index = load_json(path.read_bytes())
    except ValueError as e:  # not JSON, not UTF-8, or nested too deep
        raise CorruptFileError(f"{path}: not valid JSON ({e}); fix or download it again") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptFileError(
            f"{path}: no 'weight_map' of tensor name -> shard file; pass a Hugging Face "
            "*.safetensors.index.json or the shard files themselves."
        )
    files = dict.fromkeys(weight_map.values())
    shards = {name: SafetensorsFile(path.parent / name) for name in files}
    tensors: dict[str, Tensorish] = {}
    metadata: dict[str, str] = {}
    for shard in shards.values():
        metadata.update(shard.metadata)
        for k in shard:
            if k in tensors:
                raise CheckpointError(f"{path}: tensor {k!r} is stored in two shards")
            tensors[k] = shard.tensor_ref(k)
    held = {name: set(shard) for name, shard in shards.items()}
    for k, name in weight_map.items():
        if k not in held[name]:
            raise CorruptFileError(
                f"{path}: the index places {k!r} in {name}, which does not hold it; the shards "
                "and the index are from different downloads."
            )
    return tensors, metadata, [path, *(path.parent / name for name in shards)]
