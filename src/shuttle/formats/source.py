"""Open an adapter source into a table of (lazy) tensors, its metadata and its PEFT configs.

Sources: a ``.safetensors`` file (header only until tensors are needed), a list of them, a PEFT
adapter directory, a ``.bin``/``.pt`` pickle (``torch.load(weights_only=True)``), or an in-memory
state dict.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from shuttle.errors import AdapterFileError, AdapterFormatError, CorruptFileError
from shuttle.formats.diffusers import configs_from_metadata
from shuttle.formats.json_text import load_json
from shuttle.formats.safetensors_file import SafetensorsFile
from shuttle.patches.patch import Tensorish

__all__ = ["AdapterSource", "Source", "open_source", "tensor_dict"]

Source = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Mapping[str, torch.Tensor]
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@dataclasses.dataclass
class AdapterSource:
    """What :func:`open_source` found.

    Attributes:
        name: a description for messages (the path, or ``"<state dict>"``).
        tensors: tensor name -> tensor or lazy reference, in file order.
        metadata: safetensors ``__metadata__`` (merged over files).
        config: a PEFT config dict, from ``adapter_config.json`` or diffusers' flat metadata.
        component_configs: pipeline component name (``transformer``, ``text_encoder``, ...)
            -> the PEFT config dict diffusers stored for the tensors under ``<component>.``.
    """

    name: str
    tensors: dict[str, Tensorish]
    metadata: dict[str, str]
    config: dict[str, Any] | None
    component_configs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def open_source(source: Source) -> AdapterSource:
    """Open ``source`` without reading tensor data where the format allows.

    Raises:
        AdapterFileError: a path does not exist or has an unknown extension.
        CorruptFileError: a file is truncated or its header is inconsistent.
        AdapterFormatError: a key appears in two files, or a state dict holds non-tensors.
    """
    if isinstance(source, Mapping):
        return AdapterSource("<state dict>", tensor_dict(source, AdapterFormatError), {}, None)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            return _open_peft_dir(path)
        return _open_files([path], str(path))
    paths = [Path(p) for p in source]
    if not paths:
        raise AdapterFileError("an empty list of adapter files was given; pass at least one")
    return _open_files(paths, ", ".join(str(p) for p in paths))


def tensor_dict(source: Mapping[str, object], error: type[Exception]) -> dict[str, torch.Tensor]:
    """A copy of ``source`` after checking every value is a tensor (else ``error``)."""
    bad = [k for k, v in source.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise error(
            f"state dict values must be tensors; {bad[:4]!r} are not. Pass a dict of tensors."
        )
    return dict(source)  # type: ignore[arg-type]


def _open_files(paths: list[Path], name: str) -> AdapterSource:
    tensors: dict[str, Tensorish] = {}
    metadata: dict[str, str] = {}
    for path in paths:
        if not path.exists():
            raise AdapterFileError(f"{path}: no such file or directory")
        if path.suffix == ".safetensors":
            f = SafetensorsFile(path)
            part: dict[str, Tensorish] = {k: f.tensor_ref(k) for k in f}
            metadata.update(f.metadata)
        elif path.suffix in _PICKLE_SUFFIXES:
            part = _load_pickle(path)
        else:
            raise AdapterFileError(
                f"{path}: unknown adapter file type {path.suffix!r}; shuttle reads .safetensors, "
                f"{', '.join(_PICKLE_SUFFIXES)}, PEFT adapter directories and state dicts."
            )
        for k in part:
            if k in tensors:
                raise AdapterFormatError(
                    f"key {k!r} appears in more than one of the files {name}; pass files that "
                    "partition one adapter (or load them as separate adapters)."
                )
        tensors.update(part)
    flat, components = configs_from_metadata(metadata, name)
    return AdapterSource(name, tensors, metadata, flat, components)


def _load_pickle(path: Path) -> dict[str, Tensorish]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for bad pickles
        raise CorruptFileError(
            f"{path}: cannot be read as a weights-only torch file ({type(e).__name__}: {e}). "
            "It may be corrupt, or hold Python objects beyond tensors; convert it to .safetensors."
        ) from None
    if isinstance(sd, Mapping) and "state_dict" in sd and isinstance(sd["state_dict"], Mapping):
        sd = sd["state_dict"]
    if not isinstance(sd, Mapping):
        raise AdapterFormatError(f"{path}: holds a {type(sd).__name__}, not a dict of tensors")
    out = {str(k): v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    if len(out) != len(sd):
        bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)][:4]
        raise AdapterFormatError(f"{path}: values of {bad!r} are not tensors")
    return out


def _open_peft_dir(path: Path) -> AdapterSource:
    weights = [path / n for n in ("adapter_model.safetensors", "adapter_model.bin")]
    found = [w for w in weights if w.is_file()]
    if not found:
        raise AdapterFileError(
            f"{path}: a directory without adapter_model.safetensors or adapter_model.bin; pass "
            "a PEFT adapter directory (as written by save_pretrained) or the weight file itself."
        )
    src = _open_files([found[0]], str(found[0]))
    cfg_path = path / "adapter_config.json"
    if cfg_path.is_file():
        try:
            src.config = load_json(cfg_path.read_bytes())
        except ValueError as e:  # not JSON, not UTF-8, or nested too deep
            raise CorruptFileError(f"{cfg_path}: not valid JSON ({e}); fix or re-save it") from None
    src.name = str(path)
    return src

