"""The header check agrees with the ``safetensors`` library: what it refuses, shuttle refuses.

Each crafted file is given to ``safetensors.safe_open`` (the reference verdict) and to
:class:`SafetensorsFile`; the two must agree, and shuttle's CorruptFileError must name the
problem. Two files that safetensors reads are refused on purpose (``STRICTER``).
"""

from __future__ import annotations

import json
import struct

import pytest
from safetensors import SafetensorError, safe_open

from shuttle.errors import CorruptFileError
from shuttle.formats.safetensors_file import SafetensorsFile


def f32(begin: int, count: int = 1) -> dict:
    return {"dtype": "F32", "shape": [count], "data_offsets": [begin, begin + 4 * count]}


def file(header: dict | bytes, data_size: int = 8) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(data_size)


TWO = {"a": f32(0), "b": f32(4)}
A = b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
DEEP = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":%s}}'

# name -> (file bytes, the words shuttle's message must hold; None: both accept it)
CASES = {
    "valid": (file(TWO), None),
    "metadata": (file({"__metadata__": {"x": "1"}, **TWO}), None),
    "metadata-null": (file({"__metadata__": None, **TWO}), None),
    "metadata-key-twice-last-wins": (file(b'{"__metadata__":{"x":"1","x":"2"},' + A + b"}"),
                                     None),
    "extra-field": (file({"a": {**f32(0, 2), "x": [1, {"y": None}]}}), None),
    "zero-size-at-either-end": (file({"z": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
                                      **TWO,
                                      "y": {"dtype": "F32", "shape": [3, 0],
                                            "data_offsets": [8, 8]}}), None),
    "whitespace-around": (file(b'  {' + A + b'}  \n'), None),
    "paired-surrogates": (file(b'{"\\ud83d\\ude00":{"dtype":"F32","shape":[2],'
                               b'"data_offsets":[0,8]}}'), None),
    "nested-125": (file(DEEP % (b"[" * 125 + b"]" * 125)), None),
    "empty": (file({}, 0), None),
    # what the issue found accepted
    "tensor-twice": (file(b'{' + A.replace(b"[2]", b"[1]").replace(b"0,8", b"0,4") + b"," +
                          A.replace(b"[2]", b"[1]").replace(b"0,8", b"4,8") + b"}"),
                     "'a' more than once"),
    "trailing-bytes": (file(TWO, 9), "1 bytes after the last tensor belong to no tensor"),
    "trailing-bytes-no-tensor": (file({}, 8), "belong to no tensor"),
    "metadata-integer": (file({"__metadata__": {"x": 1}, **TWO}), "'x' is an integer"),
    "metadata-null-value": (file({"__metadata__": {"x": None}, **TWO}), "'x' is null"),
    "metadata-nested": (file({"__metadata__": {"x": {"y": "1"}}, **TWO}), "'x' is an object"),
    "metadata-list": (file({"__metadata__": [], **TWO}), "__metadata__ is a list"),
    "metadata-empty-string": (file({"__metadata__": "", **TWO}), "__metadata__ is a string"),
    # the rest of safetensors' rules
    "metadata-twice": (file(b'{"__metadata__":{},"__metadata__":{},' + A + b"}"),
                       "'__metadata__' more than once"),
    "field-twice": (file(b'{"a":{"dtype":"F32","dtype":"F32","shape":[2],'
                         b'"data_offsets":[0,8]}}'), "'dtype' more than once"),
    "gap": (file({"a": f32(0), "b": f32(8)}, 12), "bytes 4..8 of the data section"),
    "not-from-zero": (file({"a": f32(4)}, 8), "bytes 0..4"),
    "same-offsets": (file({"a": f32(0), "b": f32(0)}, 4), "overlap"),
    "zero-size-in-a-gap": (file({"z": {"dtype": "F32", "shape": [0], "data_offsets": [6, 6]},
                                 "a": f32(0), "b": f32(8)}, 12), "bytes 4..6"),
    "bool-in-shape": (file({"a": {**f32(0), "shape": [True]}, "b": f32(4)}), "invalid shape"),
    "bool-offsets": (file({"a": {**f32(0), "data_offsets": [False, 4]}, "b": f32(4)}),
                     "invalid data_offsets"),
    "float-in-shape": (file(b'{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}'),
                       "invalid shape"),
    "exponent-in-shape": (file(b'{"a":{"dtype":"F32","shape":[2e0],"data_offsets":[0,8]}}'),
                          "invalid shape"),
    "minus-zero-in-shape": (file(b'{"z":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]},'
                                 + A + b"}"), "invalid shape"),
    "shape-2**64": (file(b'{"a":{"dtype":"F32","shape":[18446744073709551616],'
                         b'"data_offsets":[0,8]}}'), "invalid shape"),
    "5000-digits": (file(b'{"a":{"dtype":"F32","shape":[' + b"1" * 5000 +
                         b'],"data_offsets":[0,8]}}'), "not valid JSON"),
    "three-offsets": (file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}'),
                      "invalid data_offsets"),
    "nan": (file(b'{"__metadata__":{"x":NaN},' + A + b"}"), "not valid JSON"),
    "infinity-in-extra": (file(DEEP % b"Infinity"), "not valid JSON"),
    "lone-surrogate-name": (file(b'{"\\ud800":{"dtype":"F32","shape":[2],'
                                 b'"data_offsets":[0,8]}}'), "not valid JSON"),
    "lone-surrogate-extra": (file(DEEP % b'"\\udc00"'), "not valid JSON"),
    "encoded-surrogate": (file(b'{"\xed\xa0\x80":{"dtype":"F32","shape":[2],'
                               b'"data_offsets":[0,8]}}'), "not valid UTF-8"),
    "bad-utf8": (file(b'{"\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
                 "not valid UTF-8"),
    "bom": (file(b"\xef\xbb\xbf{" + A + b"}"), "not valid JSON"),
    "nul-after-json": (file(b"{" + A + b"}\x00"), "not valid JSON"),
    "nested-126": (file(DEEP % (b"[" * 126 + b"]" * 126)), "deeper than 127"),
    "nested-objects-126": (file(DEEP % (b'{"k":' * 126 + b"1" + b"}" * 126)), "deeper than 127"),
    "wrong-span": (file({"a": {**f32(0, 2), "shape": [3]}}), "offsets span"),
    "past-the-end": (file({"a": f32(0, 2)}, 4), "the data section has 4"),
    "header-length-0": (struct.pack("<Q", 0) + bytes(8), "not valid JSON"),
    # the shape limits: the most dimensions read, a product past 2**64 bytes
    "dims-64": (file({"a": {"dtype": "F32", "shape": [1] * 63 + [2], "data_offsets": [0, 8]}}),
                None),
    "shape-past-2**64-bytes": (file({"a": {"dtype": "F32", "shape": [2**31, 2**31, 2],
                                           "data_offsets": [0, 0]}}, 0),
                               "beyond what torch can index"),
}
# Read by safetensors, refused by shuttle: one tensor given twice, identically (safetensors
# keeps one), and a dtype torch has no type for.
STRICTER = {
    "tensor-twice-identical": (file(b"{" + A + b"," + A + b"}"), "'a' more than once"),
    "dtype-u16": (file({"a": {"dtype": "U16", "shape": [4], "data_offsets": [0, 8]}}),
                  "unknown dtype 'U16'"),
    # no element, but torch cannot index the dims (safetensors' product stays 0)
    "shape-0-2**40-2**40": (file({"a": {"dtype": "F32", "shape": [0, 2**40, 2**40],
                                        "data_offsets": [0, 0]}}, 0),
                            "beyond what torch can index"),
    "dims-65": (file({"a": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}, 4),
                "has 65 dimensions; shuttle reads at most 64"),
}


def safetensors_verdict(path) -> str | None:
    """None if safetensors reads every tensor, else its error message."""
    try:
        with safe_open(str(path), "pt") as f:
            for k in f.keys():  # noqa: SIM118 -- safe_open is not a mapping
                f.get_tensor(k)
            f.metadata()
    except SafetensorError as e:
        return str(e)
    return None


def shuttle_verdict(path) -> str | None:
    try:
        f = SafetensorsFile(path)
        for k in f:
            f.read(k)
    except CorruptFileError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", CASES)
def test_shuttle_agrees_with_safetensors(tmp_path, name):
    data, reason = CASES[name]
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(data)
    theirs, ours = safetensors_verdict(path), shuttle_verdict(path)
    assert (theirs is None) == (reason is None), f"fixture: safetensors says {theirs!r}"
    assert (ours is None) == (theirs is None), f"safetensors: {theirs!r}; shuttle: {ours!r}"
    if reason is not None:
        assert reason in ours, ours
        assert "download or export it again" in ours


@pytest.mark.parametrize("name", STRICTER)
def test_shuttle_is_stricter_on_purpose(tmp_path, name):
    data, reason = STRICTER[name]
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(data)
    assert safetensors_verdict(path) is None
    with pytest.raises(CorruptFileError, match=reason):
        SafetensorsFile(path)


def test_metadata_key_given_twice_keeps_the_last_like_safetensors(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(CASES["metadata-key-twice-last-wins"][0])
    with safe_open(str(path), "pt") as f:
        assert SafetensorsFile(path).metadata == f.metadata() == {"x": "2"}


def test_files_safetensors_writes_are_read(tmp_path):
    import torch
    from safetensors.torch import save_file

    tensors = {"b": torch.zeros(3, dtype=torch.float16), "a": torch.ones(2, 5),
               "e": torch.empty(0, 4), "s": torch.tensor(7, dtype=torch.int8)}
    save_file(tensors, str(tmp_path / "w.safetensors"), metadata={"k": "v"})
    f = SafetensorsFile(tmp_path / "w.safetensors")
    assert f.metadata == {"k": "v"}
    for k, t in tensors.items():
        assert torch.equal(f.read(k), t)


@pytest.mark.parametrize("name", ["shape-0-2**40-2**40", "dims-65"])
def test_a_shape_only_torch_refuses_is_not_blamed_on_safetensors(tmp_path, name):
    path = tmp_path / "f.safetensors"
    path.write_bytes(STRICTER[name][0])
    with pytest.raises(CorruptFileError, match="safetensors library reads its header, but "
                                               "torch cannot hold the tensor"):
        SafetensorsFile(path)


def test_the_most_dimensions_read_give_the_tensor(tmp_path):
    import torch

    path = tmp_path / "f.safetensors"
    path.write_bytes(CASES["dims-64"][0])
    t = SafetensorsFile(path).read("a")
    assert t.shape == (1,) * 63 + (2,) and torch.equal(t.flatten(), torch.zeros(2))
