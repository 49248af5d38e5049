"""The safetensors header, checked the way the ``safetensors`` library checks it.

Two readers that disagree on one file are an attack surface (one file, two different models), so
:func:`parse_header` refuses every header that ``safetensors`` (0.8: serde_json into its
``Metadata``, then ``validate``) refuses, for the same reasons, named in a sentence:

- the JSON: strict UTF-8, no ``NaN``/``Infinity``, no lone surrogate escape, at most 127 levels
  of nesting, no tensor name given twice (Python's ``json`` keeps the last one; safetensors
  then finds the first one's bytes uncovered) and no field given twice in an entry;
- ``__metadata__``: absent, ``null`` or an object of strings (a key given twice: the last wins,
  as in safetensors);
- each entry: a dtype, a ``shape`` and two ``data_offsets`` of integers in ``[0, 2**64)``
  (not booleans, not ``1.0`` or ``-0``), the offsets spanning exactly dtype x shape bytes;
- the layout: sorted by offsets, the tensors lie back to back from byte 0 of the data section
  and the last one ends the file (no gap, no overlap, no trailing byte).

Shuttle is stricter in two ways: a dtype torch cannot hold (U16, C64, F4, ...) is refused, and so
is a tensor name given twice with identical entries (safetensors keeps one).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from shuttle.errors import CorruptFileError

__all__ = ["DTYPES", "Entry", "parse_header"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
Entry = tuple[torch.dtype, torch.Size, int, int]  # dtype, shape, data begin, data end
_FIELDS = ("dtype", "shape", "data_offsets")
_MAX_DEPTH = 127  # serde_json's recursion limit, as safetensors meets it (the top object is 1)
_MAX_DIMS = 64  # torch's own kernels index fewer; an adapter's factors have at most 5
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class _Object(dict):
    """A JSON object that remembers the keys it was given more than once."""

    __slots__ = ("repeated",)


def _object(pairs: list[tuple[str, object]]) -> _Object:
    obj = _Object(pairs)
    obj.repeated = []
    if len(obj) < len(pairs):
        seen: set[str] = set()
        obj.repeated = [k for k, _ in pairs if k in seen or seen.add(k)]
    return obj


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _int(text: str) -> int | float:
    return -0.0 if text == "-0" else int(text)  # serde_json reads -0 as a float, not a usize


def _no_lone_surrogate(header: object) -> None:
    try:  # a lone surrogate cannot be encoded; a pair was joined into one character
        json.dumps(header, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a \\u escape gives a lone UTF-16 surrogate") from None


def _depth(value: object, limit: int) -> int:
    """Nesting depth of a JSON value (a scalar is 0), counted no further than ``limit``."""
    if not isinstance(value, (list, dict)):
        return 0
    if limit <= 1:
        return 1
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(c, limit - 1) for c in children), default=0)


def _type(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", type(None): "null"}.get(type(value), "an object")


def parse_header(raw: bytes, data_size: int, path: Path) -> tuple[dict[str, str], dict[str, Entry]]:
    """Parse and check a safetensors header against the size of the data that follows it.

    Args:
        raw: the header's JSON bytes (after the 8-byte length).
        data_size: bytes of the file after the header.
        path: the file, for messages.

    Returns:
        The ``__metadata__`` strings, and tensor name -> (dtype, shape, begin, end) in header
        order, offsets relative to the data section.

    Raises:
        CorruptFileError: the header is refused (the message says why, in safetensors' terms).
    """
    def corrupt(what: str, theirs: bool = True) -> CorruptFileError:
        # theirs: the safetensors library refuses it too; else only torch cannot hold it
        why = ("the safetensors library refuses it too" if theirs else
               "the safetensors library reads its header, but torch cannot hold the tensor")
        return CorruptFileError(f"{path}: {what}. The file is truncated or corrupt ({why}); "
                                "download or export it again.")

    try:
        text = raw.decode("utf-8")  # strict: json.loads(bytes) would let encoded surrogates pass
        header = json.loads(text, object_pairs_hook=_object, parse_constant=_constant,
                            parse_int=_int)
        if _SURROGATE_ESCAPE.search(raw):
            _no_lone_surrogate(header)
    except UnicodeError as e:
        raise corrupt(f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except (ValueError, RecursionError) as e:  # also the 4300-digit limit of int()
        raise corrupt(f"header is not valid JSON ({e})") from None
    if not isinstance(header, _Object):
        raise corrupt(f"header is {_type(header)}, not a JSON object")
    if header.repeated:
        raise corrupt(f"header names {header.repeated[0]!r} more than once")
    meta = header.pop("__metadata__", None)
    if meta is not None and not isinstance(meta, dict):
        raise corrupt(f"__metadata__ is {_type(meta)}, not a JSON object of strings")
    for k, v in (meta or {}).items():
        if not isinstance(v, str):
            raise corrupt(f"__metadata__ value of {k!r} is {_type(v)}, not a string")
    entries = {key: _entry(key, entry, data_size, corrupt) for key, entry in header.items()}
    at, previous = 0, None
    for begin, end, key in sorted((e[2], e[3], k) for k, e in entries.items()):
        if begin < at:
            raise corrupt(f"tensors {previous!r} and {key!r} overlap in the data")
        if begin > at:
            raise corrupt(f"bytes {at}..{begin} of the data section, before tensor {key!r}, "
                          "belong to no tensor (safetensors: invalid offset)")
        at, previous = end, key
    if at != data_size:
        raise corrupt(f"{data_size - at} bytes after the last tensor belong to no tensor "
                      "(safetensors: file not fully covered)")
    return dict(meta or {}), entries


def _entry(key: str, entry: object, data_size: int, corrupt) -> Entry:
    if not isinstance(entry, _Object):
        raise corrupt(f"entry {key!r} is {_type(entry)}, not an object")
    if entry.repeated:
        raise corrupt(f"entry {key!r} gives the field {entry.repeated[0]!r} more than once")
    for field, value in entry.items():
        if field not in _FIELDS and _depth(value, _MAX_DEPTH) > _MAX_DEPTH - 2:
            raise corrupt(f"entry {key!r} nests {field!r} deeper than {_MAX_DEPTH} levels")
    name = entry.get("dtype")
    dtype = DTYPES.get(name) if isinstance(name, str) else None  # a list is unhashable
    if dtype is None:
        raise corrupt(f"tensor {key!r} has unknown dtype {name!r}")

    def integers(value: object) -> bool:
        return isinstance(value, list) and all(
            type(d) is int and 0 <= d < 2**64 for d in value)  # bool is an int subclass

    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not integers(shape):
        raise corrupt(f"tensor {key!r} has an invalid shape {shape!r}")
    if not (integers(offsets) and len(offsets) == 2):
        raise corrupt(f"tensor {key!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise corrupt(f"tensor {key!r} spans bytes {begin}..{end} but the data section has "
                      f"{data_size}")
    if len(shape) > _MAX_DIMS:
        raise corrupt(f"tensor {key!r} has {len(shape)} dimensions; shuttle reads at most "
                      f"{_MAX_DIMS}", theirs=False)
    count, extent = 1, 1  # extent: the dims without zeros, which torch must still index
    for d in shape:
        count, extent = count * d, extent * max(d, 1)
        if extent >= 2**63:
            # safetensors multiplies the dims in order, then by the item size, and refuses a
            # product past 2**64 - 1 (a zero dim first keeps it 0)
            products = [math.prod(shape[:j + 1]) for j in range(len(shape))]
            theirs = max(products) >= 2**64 or products[-1] * dtype.itemsize >= 2**64
            raise corrupt(f"tensor {key!r} has a shape {shape} beyond what torch can index",
                          theirs=theirs)
    if count * dtype.itemsize != end - begin:
        raise corrupt(f"tensor {key!r} of shape {shape} and dtype {name} needs "
                      f"{count * dtype.itemsize} bytes but its offsets span {end - begin}")
    return dtype, torch.Size(shape), begin, end
