"""Checkpoints whose bfloat16/float16 tensors are lossless coded: writing and reading them.

A compressed checkpoint is a valid safetensors file: every coded tensor is stored under its own
name as a ``U8`` tensor holding its :class:`~shuttle.weights.lossless.LosslessTensor` blob,
every other tensor as it was, and ``__metadata__["shuttle.lossless"]`` says which are coded:

    {"version": 2, "lanes": 128, "steps": 256, "max_len": 12,
     "tensors": {"blocks.0.attn.qkv.weight": {"dtype": "BF16", "shape": [9216, 3072],
                                              "words": 1234567}, ...}}

(the file's other metadata is kept). Other tools open it and see the blobs as bytes;
:func:`open_decoded` opens it (or any checkpoint) with the coded tensors decoded on read, to the
exact original bits, so ``shuttle.load_checkpoint`` and the integrations' ``from_pretrained``
read it like the original.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from tqdm.auto import tqdm

from shuttle.errors import AdapterFileError, CorruptCodeError, CorruptFileError, ShuttleError
from shuttle.formats.model_checkpoint import (
    Checkpoint,
    CheckpointSource,
    open_checkpoint,
    refuse_overwrite,
)
from shuttle.formats.safetensors_file import DTYPES, SafetensorsFile
from shuttle.formats.safetensors_writer import (
    SafetensorsWriter,
    create_temp,
    publish_mode,
    staged_folder,
)
from shuttle.kernels.exponent_decode import LANES, MAX_LEN, STEPS
from shuttle.patches.patch import materialize
from shuttle.weights.lossless import CODED_DTYPES, LosslessTensor, blob_nbytes

__all__ = ["LOSSLESS_KEY", "CodedRef", "CompressReport", "compress_file", "compress_folder",
           "coded_entries", "open_decoded"]

LOSSLESS_KEY = "shuttle.lossless"
_VERSION = 2  # 2: the lookup table stored short codes first (exponent_decode.table_index)
_NAMES = {v: k for k, v in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class CompressReport:
    """What :func:`compress_file` wrote.

    Attributes:
        path: the file written.
        tensors: tensors in the file.
        coded: of them, those stored coded.
        raw_bytes: tensor bytes of the input.
        stored_bytes: tensor bytes of the output.
    """

    path: Path
    tensors: int
    coded: int
    raw_bytes: int
    stored_bytes: int

    @property
    def ratio(self) -> float:
        """Stored bytes over raw bytes."""
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0


class CodedRef:
    """A coded tensor of a checkpoint file: shape and dtype known, decoded when loaded.

    Args:
        blob: the file's lazy reference to the ``U8`` blob.
        shape, dtype, words: from the file's ``shuttle.lossless`` metadata.
    """

    def __init__(self, blob: object, shape: torch.Size, dtype: torch.dtype, words: int):
        self.blob = blob
        self.shape = shape
        self.dtype = dtype
        self.words = words

    @property
    def key(self) -> str:
        """The tensor's name in its file."""
        return str(getattr(self.blob, "key", "a coded tensor"))

    @property
    def nbytes(self) -> int:
        """Bytes of the decoded tensor."""
        return math.prod(self.shape) * self.dtype.itemsize

    def layout(self) -> LosslessTensor:
        """The coded tensor's layout (shape, dtype, words) with a ``meta`` blob: nothing read."""
        blob = torch.empty(blob_nbytes(math.prod(self.shape), self.words), dtype=torch.uint8,
                           device="meta")
        return LosslessTensor(blob, self.shape, self.dtype, self.words)

    def coded(self) -> LosslessTensor:
        """The coded tensor, its blob read into memory.

        Raises:
            CorruptCodeError: the blob has not the size its layout needs.
        """
        rep = LosslessTensor(materialize(self.blob), self.shape, self.dtype, self.words)
        rep.parts()  # the size check
        return rep

    def load(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The original tensor, decoded (on ``device``, default the CPU).

        Raises:
            CorruptCodeError: the blob was damaged (the message names the tensor).
        """
        try:
            return self.coded().decode(device)
        except CorruptCodeError as e:
            raise CorruptCodeError(f"{self.key}: {e}") from None

    def __repr__(self) -> str:
        return f"CodedRef({tuple(self.shape)}, {self.dtype}, {self.blob!r})"


def coded_entries(metadata: Mapping[str, str], where: str = "the file"
                  ) -> dict[str, tuple[torch.dtype, torch.Size, int]]:
    """Coded tensor name -> ``(dtype, shape, words)`` from a file's metadata (empty when the
    file is not compressed).

    Raises:
        CorruptFileError: the ``shuttle.lossless`` entry is malformed or of another layout.
    """
    text = metadata.get(LOSSLESS_KEY)
    if text is None:
        return {}
    try:
        meta = json.loads(text)
        layout = (meta["version"], meta["lanes"], meta["steps"], meta["max_len"])
        out = {}
        for name, e in meta["tensors"].items():
            dtype = DTYPES[e["dtype"]]
            if dtype not in CODED_DTYPES or int(e["words"]) < 0:
                raise ValueError(name)
            out[name] = (dtype, torch.Size(int(d) for d in e["shape"]), int(e["words"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptFileError(f"{where}: its {LOSSLESS_KEY!r} metadata is malformed ({e!r}); "
                               "write it again with `shuttle compress`") from e
    if layout != (_VERSION, LANES, STEPS, MAX_LEN):
        raise CorruptFileError(
            f"{where} was coded with layout (version, lanes, steps, max_len) = {layout}; this "
            f"shuttle reads {(_VERSION, LANES, STEPS, MAX_LEN)}: decode it with the shuttle "
            "that wrote it, or compress the original again")
    return out


def open_decoded(source: CheckpointSource) -> Checkpoint:
    """:func:`~shuttle.formats.model_checkpoint.open_checkpoint`, with every coded tensor of a
    compressed file as a :class:`CodedRef` (decoded when read) and the ``shuttle.lossless``
    metadata removed.

    Raises:
        CorruptFileError: the metadata is malformed, or a blob's size disagrees with it.
        Whatever :func:`open_checkpoint` raises.
    """
    ckpt = open_checkpoint(source)
    entries: dict[str, tuple[torch.dtype, torch.Size, int]] = {}
    for path in ckpt.files:  # each shard of an index was compressed on its own
        if path.suffix == ".safetensors":
            entries.update(coded_entries(SafetensorsFile(path).metadata, str(path)))
    if not entries:
        return ckpt
    tensors = dict(ckpt.tensors)
    for name, (dtype, shape, words) in entries.items():
        blob = tensors.get(name)
        size = blob_nbytes(math.prod(shape), words)
        if blob is None or blob.dtype != torch.uint8 or tuple(blob.shape) != (size,):
            raise CorruptFileError(
                f"{ckpt.name}: coded tensor {name!r} should be a U8 tensor of {size} bytes; "
                f"the file holds {None if blob is None else (blob.dtype, tuple(blob.shape))}: "
                "write it again with `shuttle compress`")
        tensors[name] = CodedRef(blob, shape, dtype, words)
    metadata = {k: v for k, v in ckpt.metadata.items() if k != LOSSLESS_KEY}
    return dataclasses.replace(ckpt, tensors=tensors, metadata=metadata)


def compress_file(source: str | os.PathLike[str], out: str | os.PathLike[str], *,
                  overwrite: bool = False, progress: bool = True) -> CompressReport:
    """Write ``source`` (one safetensors file) to ``out`` with its bfloat16/float16 tensors
    lossless coded where that makes them smaller (the rest as they are).

    Each tensor is coded twice, once to size the header and once to write it, so that no more
    than one tensor's code is held in memory. ``out`` appears complete or not at all.

    Args:
        source: the checkpoint (a compressed one is refused: nothing to gain).
        out: the file to write.
        overwrite: replace ``out`` if it exists.
        progress: show a progress bar.

    Returns:
        A :class:`CompressReport`.

    Raises:
        ShuttleError: ``source`` is compressed already.
        AdapterFileError / CorruptFileError: ``source`` cannot be read, ``out`` is ``source``,
            or ``out`` exists (without ``overwrite``).
    """
    src = SafetensorsFile(source)
    out = Path(out)
    refuse_overwrite([out], [source])
    if out.exists() and not overwrite:
        raise AdapterFileError(f"{out} exists; pass overwrite=True (`--force`) to replace it")
    if LOSSLESS_KEY in src.metadata:
        raise ShuttleError(f"{source} is compressed already; nothing to gain")
    raw = {k: src.tensor_ref(k) for k in src}
    entries: dict[str, tuple[torch.dtype, list[int]]] = {}
    coded: dict[str, dict[str, object]] = {}
    # Two passes: the header (written first) needs every blob's size, which the code's lengths
    # give without coding (LosslessTensor.code_size, a fifth of coding's time); the second
    # pass codes and writes one tensor at a time.
    total = sum(r.nbytes for r in raw.values())
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
              desc=f"sizing {Path(source).name}") as bar:
        for name, ref in raw.items():
            size = (LosslessTensor.code_size(ref.load()) if ref.dtype in CODED_DTYPES
                    else None)
            if size is None:
                entries[name] = (ref.dtype, list(ref.shape))
            else:
                entries[name] = (torch.uint8, [size[1]])
                coded[name] = {"dtype": _NAMES[ref.dtype], "shape": list(ref.shape),
                               "words": size[0]}
            bar.update(ref.nbytes)
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
               desc=f"compressing {Path(source).name}")
    with bar:
        meta = dict(src.metadata)
        meta[LOSSLESS_KEY] = json.dumps({"version": _VERSION, "lanes": LANES, "steps": STEPS,
                                         "max_len": MAX_LEN, "tensors": coded},
                                        separators=(",", ":"))
        temp = create_temp(out)
        try:
            with SafetensorsWriter(temp, entries, meta) as writer:
                for name in writer.order:
                    t = raw[name].load()
                    if name in coded:
                        rep = LosslessTensor.encode_host(t)
                        assert rep is not None and rep.words == coded[name]["words"]
                        t = rep.blob
                    writer.write(name, t)
                    bar.update(raw[name].nbytes)
            publish_mode(temp)
            os.replace(temp, out)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
    return CompressReport(out, len(raw), len(coded), sum(r.nbytes for r in raw.values()),
                          writer.nbytes)


def compress_folder(source: str | os.PathLike[str], out: str | os.PathLike[str], *,
                    overwrite: bool = False, progress: bool = True) -> list[CompressReport]:
    """Write a copy of the folder ``source`` (a diffusers pipeline, a transformers model, any
    tree of checkpoints) to ``out`` with every ``.safetensors`` file compressed as
    :func:`compress_file` does and every other file copied as it is (symlinks followed, as in
    a Hugging Face cache snapshot). Tensor names and file names stay, so index files stay
    valid and the integrations' ``from_pretrained`` loads ``out`` as it loads ``source``.

    ``out`` appears complete or not at all (written beside it, then renamed).

    Args:
        source: the folder to read.
        out: the folder to write (must not exist, unless ``overwrite``: then it is replaced).
        overwrite: replace ``out`` if it exists.
        progress: show a progress bar per file.

    Returns:
        One :class:`CompressReport` per weight file, in path order (``path`` under ``out``).

    Raises:
        AdapterFileError: ``source`` is not a folder or holds no ``.safetensors`` file, ``out``
            exists (without ``overwrite``; or is a file), or lies inside ``source`` (or is it).
        ShuttleError: a weight file is compressed already.
    """
    src, out = Path(source), Path(out)
    if not src.is_dir():
        raise AdapterFileError(f"{src} is not a folder; pass a folder, or use compress_file "
                               "for one file")
    files = sorted(p for p in src.rglob("*") if p.is_file())
    if not any(p.suffix == ".safetensors" for p in files):
        raise AdapterFileError(f"{src} holds no .safetensors file: nothing to compress")
    reports = []
    with staged_folder(src, out, overwrite) as part:
        for f in files:
            dest = part / f.relative_to(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if f.suffix == ".safetensors":
                report = compress_file(f, dest, progress=progress)
                reports.append(dataclasses.replace(report, path=out / f.relative_to(src)))
            else:
                shutil.copyfile(f, dest)
    return reports
