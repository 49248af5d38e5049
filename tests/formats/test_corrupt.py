"""Corrupt adapter files: every failure is a typed ShuttleError, never a raw exception or a crash.

A valid small kohya safetensors file is damaged in many ways (hypothesis draws the damage):
truncated, bytes flipped in the header or anywhere, the header rewritten with lying
dtypes/shapes/offsets (inconsistent ones, and consistent ones that keep the byte count), or
replaced by bytes that are not JSON. Loading must raise CorruptFileError where the file's own
structure is broken; where the header is still valid JSON describing garbled keys or shapes, any
ShuttleError subclass (AdapterFormatError, UnknownKeyError, ...) is accepted. If a damaged file
still loads, merging it must either succeed with finite weights or raise a ShuttleError.

Each example writes a new file: a loaded adapter maps its file lazily, so a file must never be
rewritten under a live adapter.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

import shuttle
from shuttle.errors import (
    AdapterFormatError,
    CorruptFileError,
    NonFiniteAdapterError,
    ShuttleError,
)
from shuttle.formats.safetensors_file import DTYPES, SafetensorsFile

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow])
_ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.conv = nn.Conv2d(2, 3, 3).half()
        self.one = nn.Linear(1, 1, bias=False).to(torch.bfloat16)


def valid_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "lora_unet_lin.lora_down.weight": torch.randn(2, 8, generator=g),
        "lora_unet_lin.lora_up.weight": torch.randn(4, 2, generator=g),
        "lora_unet_lin.alpha": torch.tensor(1.0),
        "lora_unet_conv.lora_down.weight": torch.randn(1, 2, 3, 3, generator=g).half(),
        "lora_unet_conv.lora_up.weight": torch.randn(3, 1, 1, 1, generator=g).half(),
        "lora_unet_conv.alpha": torch.tensor(1.0, dtype=torch.float16),
        "lora_unet_one.lora_down.weight": torch.randn(1, 1, generator=g).bfloat16(),
        "lora_unet_one.lora_up.weight": torch.randn(1, 1, generator=g).bfloat16(),
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("corrupt")


@pytest.fixture(scope="module")
def valid_bytes(workdir) -> bytes:
    path = workdir / "valid.safetensors"
    save_file(valid_tensors(), str(path), metadata={"ss_network_dim": "2"})
    data = path.read_bytes()
    # The pristine file loads and merges: the damage below is what breaks it.
    report = shuttle.merge_lora(Net(), [(shuttle.load_lora(path), 1.0)])
    assert len(report.applied) == 3
    return data


_names = itertools.count()


def write(workdir, data: bytes, suffix: str = ".safetensors"):
    path = workdir / f"case{next(_names)}{suffix}"
    path.write_bytes(data)
    return path


def split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header: object, body: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def load_and_merge(path) -> None:
    """Load ``path``; if that works, merge it. Only ShuttleErrors may escape."""
    try:
        lora = shuttle.load_lora(path)
    except ShuttleError:
        return
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        shuttle.merge_lora(model, [(lora, 1.0)])
    except NonFiniteAdapterError:
        return  # an overflow found while writing may follow earlier merged parameters
    except ShuttleError:
        for n, p in model.named_parameters():  # validated before any write
            assert torch.equal(p, before[n]), n
        return
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), f"{n} holds NaN or infinity after a merge"


# -- truncation -----------------------------------------------------------------------------------

@SETTINGS
@given(data=st.data())
def test_truncated_file(workdir, valid_bytes, data):
    cut = data.draw(st.integers(0, len(valid_bytes) - 1), label="length")
    path = write(workdir, valid_bytes[:cut])
    with pytest.raises(CorruptFileError):
        shuttle.load_lora(path)


def test_every_truncation_of_the_header_region(workdir, valid_bytes):
    (n,) = struct.unpack("<Q", valid_bytes[:8])
    for cut in range(0, 8 + n + 1):
        with pytest.raises(CorruptFileError):
            shuttle.load_lora(write(workdir, valid_bytes[:cut]))


# -- flipped bytes --------------------------------------------------------------------------------

def _flip(raw: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(raw)
    for pos, mask in flips:
        out[pos % len(out)] ^= mask
    return bytes(out)


@SETTINGS
@given(data=st.data())
def test_flipped_header_bytes(workdir, valid_bytes, data):
    (n,) = struct.unpack("<Q", valid_bytes[:8])
    flips = data.draw(st.lists(st.tuples(st.integers(0, 8 + n - 1), st.integers(1, 255)),
                               min_size=1, max_size=4), label="flips")
    load_and_merge(write(workdir, _flip(valid_bytes, flips)))


@SETTINGS
@given(data=st.data())
def test_flipped_bytes_anywhere(workdir, valid_bytes, data):
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(valid_bytes) - 1),
                                         st.integers(1, 255)), min_size=1, max_size=6),
                      label="flips")
    load_and_merge(write(workdir, _flip(valid_bytes, flips)))


@SETTINGS
@given(data=st.data())
def test_flipped_data_bytes_keep_the_header_valid(workdir, valid_bytes, data):
    """Damage confined to tensor data: the file opens; NaN/inf payloads are caught by type."""
    (n,) = struct.unpack("<Q", valid_bytes[:8])
    flips = data.draw(st.lists(st.tuples(st.integers(8 + n, len(valid_bytes) - 1),
                                         st.integers(1, 255)), min_size=1, max_size=6),
                      label="flips")
    path = write(workdir, _flip(valid_bytes, flips))
    try:
        lora = shuttle.load_lora(path)
    except AdapterFormatError as e:  # of the data, only 0-dim alphas are read at load
        assert "alpha" in str(e)
    else:
        assert len(lora.modules) == 3
    load_and_merge(path)


# -- lying headers --------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=8,
)
dtype_lies = st.sampled_from([*DTYPES, "F12", "", "f32", "U16", "I4", "F8_E8M0", "C64"])
shape_lies = st.lists(st.integers(-3, 2**40), max_size=4) | st.lists(
    st.integers(0, 9) | st.floats(0, 9) | st.booleans() | st.text(max_size=2), max_size=4)
offset_lies = st.lists(st.integers(-10, 2**62), min_size=0, max_size=3)


@st.composite
def lying_header(draw, header: dict):
    header = json.loads(json.dumps(header))  # a deep copy
    keys = [k for k in header if k != "__metadata__"]
    action = draw(st.sampled_from(["field", "drop-field", "drop-entry", "entry", "rename",
                                   "add-entry", "metadata", "top-level"]))
    key = draw(st.sampled_from(keys))
    if action == "field":
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        plausible = {"dtype": dtype_lies, "shape": shape_lies, "data_offsets": offset_lies}
        header[key][field] = draw(plausible[field] | json_values)
    elif action == "drop-field":
        del header[key][draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
    elif action == "drop-entry":
        del header[key]
    elif action == "entry":
        header[key] = draw(json_values)
    elif action == "rename":
        header[draw(st.text(max_size=40))] = header.pop(key)
    elif action == "add-entry":
        header[draw(st.text(max_size=20))] = {"dtype": draw(dtype_lies), "shape": draw(shape_lies),
                                              "data_offsets": draw(offset_lies)}
    elif action == "metadata":
        header["__metadata__"] = draw(json_values)
    else:
        return draw(json_values)
    return header


@SETTINGS
@given(data=st.data())
def test_lying_header_fields(workdir, valid_bytes, data):
    header, body = split(valid_bytes)
    lie = data.draw(lying_header(header), label="header")
    load_and_merge(write(workdir, join(lie, body)))


def _factorizations(n: int, parts: int) -> list[list[int]]:
    if parts == 1:
        return [[n]]
    return [[d, *rest] for d in range(1, n + 1) if n % d == 0
            for rest in _factorizations(n // d, parts - 1)]


@st.composite
def consistent_lie(draw, header: dict):
    """One entry's dtype and shape changed so that its byte count stays right."""
    header = json.loads(json.dumps(header))
    key = draw(st.sampled_from([k for k in header if k != "__metadata__"]))
    begin, end = header[key]["data_offsets"]
    nbytes = end - begin
    dtype = draw(st.sampled_from([d for d, size in _ITEMSIZE.items() if nbytes % size == 0]))
    count = nbytes // _ITEMSIZE[dtype]
    rank = draw(st.integers(0 if count == 1 else 1, 4))
    shape = draw(st.sampled_from(_factorizations(count, rank))) if rank else []
    header[key]["dtype"], header[key]["shape"] = dtype, shape
    return header


@SETTINGS
@given(data=st.data())
def test_consistent_lies_about_dtype_and_shape(workdir, valid_bytes, data):
    header, body = split(valid_bytes)
    for _ in range(data.draw(st.integers(1, 3), label="entries")):
        header = data.draw(consistent_lie(header), label="lie")
    load_and_merge(write(workdir, join(header, body)))


@pytest.mark.parametrize("change", [
    lambda h: h["lora_unet_lin.lora_up.weight"].update(data_offsets=[0, 32]),  # overlaps down
    lambda h: h["lora_unet_lin.lora_up.weight"].update(shape=[4, 3]),
    lambda h: h["lora_unet_lin.lora_up.weight"].update(dtype="F64"),
    lambda h: h["lora_unet_lin.lora_up.weight"].update(data_offsets=[10**12, 10**12 + 32]),
    lambda h: h["lora_unet_lin.lora_up.weight"].update(data_offsets=[64, 32]),
    lambda h: h["lora_unet_lin.lora_up.weight"].update(shape=[-4, -2]),
    lambda h: h["lora_unet_lin.lora_up.weight"].update(shape=[2**62, 2**62]),
    lambda h: h["lora_unet_lin.lora_up.weight"].update(dtype=["F32"]),
    lambda h: h["lora_unet_lin.lora_up.weight"].update(dtype={"F32": 1}),
    lambda h: h["lora_unet_lin.lora_up.weight"].update(shape="4,2"),
    lambda h: h["lora_unet_lin.lora_up.weight"].update(data_offsets=[0.0, 32.0]),
    lambda h: h["lora_unet_lin.lora_up.weight"].pop("dtype"),
    lambda h: h.update({"lora_unet_lin.lora_up.weight": [4, 2]}),
    lambda h: h.update({"__metadata__": ["not", "a", "dict"]}),
], ids=["overlap", "shape", "dtype", "far-offsets", "reversed-offsets", "negative-shape",
        "huge-shape", "dtype-list", "dtype-dict", "shape-str", "float-offsets", "no-dtype",
        "entry-list", "metadata-list"])
def test_specific_header_lies_are_corrupt(workdir, valid_bytes, change):
    header, body = split(valid_bytes)
    change(header)
    with pytest.raises(CorruptFileError):
        shuttle.load_lora(write(workdir, join(header, body)))


@pytest.mark.parametrize("how", ["smaller-shape", "longer-span"])
def test_a_span_longer_than_dtype_times_shape_is_corrupt_at_open(workdir, valid_bytes, how):
    """data_offsets spanning more bytes than dtype x shape, inside the data and overlapping no
    other tensor: only the span-length check sees it, when the file is opened."""
    header, body = split(valid_bytes)
    if how == "smaller-shape":  # (4, 2) float32 in 32 bytes claimed as (2, 2): 16 bytes
        key = "lora_unet_lin.lora_up.weight"
        header[key]["shape"] = [2, 2]
    else:  # the last tensor of the data section grows into 16 appended bytes
        key = max((k for k in header if k != "__metadata__"),
                  key=lambda k: header[k]["data_offsets"][1])
        header[key]["data_offsets"][1] += 16
        body += bytes(16)
    path = write(workdir, join(header, body))
    with pytest.raises(CorruptFileError, match=f"{re.escape(repr(key))}.*offsets span"):
        SafetensorsFile(path)


# -- headers that are not JSON --------------------------------------------------------------------

@SETTINGS
@given(data=st.data())
def test_non_json_header(workdir, valid_bytes, data):
    _, body = split(valid_bytes)
    raw = data.draw(st.binary(max_size=300) | st.text(max_size=100).map(str.encode), label="raw")
    path = write(workdir, join(raw, body))
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict):
        with pytest.raises(ShuttleError):
            shuttle.load_lora(path)
    else:
        with pytest.raises(CorruptFileError):
            shuttle.load_lora(path)


@SETTINGS
@given(length=st.integers(0, 2**64 - 1))
def test_lying_header_length(workdir, valid_bytes, length):
    header, body = split(valid_bytes)
    raw = json.dumps(header).encode()
    path = write(workdir, struct.pack("<Q", length) + raw + body)
    if length == len(raw):
        shuttle.load_lora(path)
    else:
        with pytest.raises(ShuttleError):
            shuttle.load_lora(path)


@pytest.mark.parametrize("raw", [
    b"", b"{", b"[]", b"null", b"1", b'"x"', b"\xff\xfe{}", b"{}" + b"\x00" * 6,
    b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'{"x": NaN}', b'{"x": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}',
], ids=["empty", "open-brace", "list", "null", "int", "string", "bom", "nul-padding",
        "deep-list", "deep-dict", "nan", "huge-float"])
def test_specific_non_json_headers(workdir, valid_bytes, raw):
    _, body = split(valid_bytes)
    with pytest.raises(CorruptFileError):
        shuttle.load_lora(write(workdir, join(raw, body)))


def test_empty_header_object_is_not_an_adapter(workdir, valid_bytes):
    with pytest.raises(AdapterFormatError):
        shuttle.load_lora(write(workdir, join(b"{}", b"")))
    _, body = split(valid_bytes)  # then the data belongs to no tensor
    with pytest.raises(CorruptFileError, match="belong to no tensor"):
        shuttle.load_lora(write(workdir, join(b"{}", body)))


def test_file_shorter_than_the_length_prefix(workdir):
    for data in (b"", b"\x08", b"\x00" * 7):
        with pytest.raises(CorruptFileError):
            shuttle.load_lora(write(workdir, data))


# -- pickled .bin / .pt ---------------------------------------------------------------------------

CALLS: list[str] = []


def _record(what: str) -> None:
    CALLS.append(what)


class Payload:
    """Unpickling this would call ``_record``: weights_only must refuse before that."""

    def __reduce__(self):
        return (_record, ("unpickled",))


class Plain:
    def __init__(self):
        self.x = 1


@pytest.mark.parametrize("obj", [Payload(), Plain(), math.sqrt], ids=["reduce", "object",
                                                                        "function"])
def test_pickled_non_tensor_object_is_rejected(workdir, obj):
    sd = {"lora_unet_lin.lora_down.weight": torch.randn(2, 8),
          "lora_unet_lin.lora_up.weight": torch.randn(4, 2), "extra": obj}
    for suffix in (".bin", ".pt"):
        path = workdir / f"pickled{next(_names)}{suffix}"
        torch.save(sd, path)
        with pytest.raises(CorruptFileError, match="weights-only"):
            shuttle.load_lora(path)
    assert CALLS == []


def test_pickled_file_with_non_tensor_values_or_shapes(workdir):
    cases = [{"lora_unet_lin.lora_down.weight": torch.randn(2, 8), "note": "hello"},
             [torch.randn(2, 8)], torch.randn(3)]
    for obj in cases:
        path = workdir / f"pickled{next(_names)}.bin"
        torch.save(obj, path)
        with pytest.raises(AdapterFormatError):
            shuttle.load_lora(path)


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_truncated_or_garbled_pickle(workdir, data):
    good = workdir / f"pickled{next(_names)}.bin"
    torch.save({"lora_unet_lin.lora_down.weight": torch.randn(2, 8),
                "lora_unet_lin.lora_up.weight": torch.randn(4, 2)}, good)
    raw = good.read_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1), label="length")
    garbled = data.draw(st.booleans(), label="garbled")
    damaged = _flip(raw, [(cut, 0x5A)]) if garbled else raw[:cut]
    path = write(workdir, damaged, ".bin")
    try:
        lora = shuttle.load_lora(path)
    except ShuttleError as e:
        if not garbled:
            assert isinstance(e, CorruptFileError)
        return
    assert garbled  # a flipped byte may land in a part of the zip nothing checks
    assert lora.modules
    load_and_merge(path)


def test_random_bytes_as_pickle(workdir):
    g = torch.Generator().manual_seed(1)
    for size in (0, 1, 16, 1000):
        raw = bytes(torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8).tolist())
        with pytest.raises(CorruptFileError):
            shuttle.load_lora(write(workdir, raw, ".bin"))
