"""Fuzzed safetensors adapters: load_lora, reading every tensor and a merge raise only
ShuttleErrors (or succeed); never a raw Python or torch exception, a hang or a crash.

Hypothesis draws small files three ways: a header built from entries (names that land on the
model or not, dtypes real and bogus, shapes, offsets consistent or perturbed, metadata of any
JSON) over random tensor bytes; that header's bytes then damaged (flipped, cut, spliced); and
header bytes that are random outright. Declared dims stay <= 9 and the data <= ~2 KiB, so no
example can ask for much memory; max_examples and a per-example deadline keep the run < 10 s.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import struct

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import shuttle
from shuttle.errors import ShuttleError
from shuttle.formats.safetensors_file import DTYPES, LazyTensor

SETTINGS = settings(max_examples=300, deadline=2000, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.conv = nn.Conv2d(2, 3, 3).half()


MODULES = ["lora_unet_lin", "lora_unet_conv", "base_model.model.lin", "lin", "conv",
           "lora_te_x"]
SUFFIXES = [".lora_down.weight", ".lora_up.weight", ".alpha", ".lora_A.weight",
            ".lora_B.weight", ".hada_w1_a", ".hada_w1_b", ".lokr_w1", ".lokr_w2", ".diff",
            ".dora_scale", ".weight", ".lora_mid.weight"]
names = st.tuples(st.sampled_from(MODULES), st.sampled_from(SUFFIXES)).map("".join) | st.text(
    max_size=12)
dtypes = st.sampled_from([*DTYPES, "U16", "F12", ""])
shapes = st.lists(st.integers(0, 9), max_size=4)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=6,
)
metadata = st.none() | st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3) \
    | st.dictionaries(st.sampled_from(["ss_network_dim", "ss_network_alpha", "format"]),
                      st.text(max_size=8) | json_values, max_size=3) | json_values


@st.composite
def built(draw) -> tuple[bytes, bytes]:
    """A header from drawn entries, laid out back to back, and random data bytes."""
    header: dict[str, object] = {}
    meta = draw(metadata)
    if meta is not None or draw(st.booleans()):
        header["__metadata__"] = meta
    offset = 0
    for name, dtype, shape in draw(st.lists(st.tuples(names, dtypes, shapes), max_size=6)):
        size = _ITEMSIZE.get(dtype, 4)
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
        if draw(st.integers(0, 9)) == 0:  # now and then, one lie
            field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            header[name][field] = draw(json_values | st.lists(st.integers(-2, 2**40),
                                                              max_size=3))
    body = draw(st.binary(min_size=offset, max_size=offset))
    body = body[:max(0, offset - draw(st.integers(0, 2)))] + bytes(draw(st.integers(0, 2)))
    return json.dumps(header).encode(), body


@st.composite
def damaged(draw) -> tuple[bytes, bytes]:
    raw, body = draw(built())
    raw = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, max(0, len(raw) - 1)))
        how = draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip" and raw:
            raw[pos] ^= draw(st.integers(1, 255))
        elif how == "cut":
            del raw[pos:pos + draw(st.integers(1, 8))]
        else:
            raw[pos:pos] = draw(st.sampled_from([b"[", b"{", b"}", b'"', b",", b"-0", b"1e9",
                                                 b"NaN", b"\\ud800", b"\xff", b"\x00"]))
    return bytes(raw), body


random_header = st.tuples(st.binary(max_size=200), st.binary(max_size=64))
files = st.one_of(built(), damaged(), random_header)
_names = itertools.count()


def check(path) -> None:
    """Load, read every tensor both ways, merge: only ShuttleErrors may escape."""
    try:
        lora = shuttle.load_lora(path)
    except ShuttleError:
        return
    for patches in lora.modules.values():
        for patch in patches:
            for _, t in patch.tensors():
                if isinstance(t, LazyTensor):
                    assert torch.equal(t.load().view(torch.uint8),
                                       t.load(copy=True).view(torch.uint8))
    with contextlib.suppress(ShuttleError):
        shuttle.merge_lora(Net(), [(lora, 1.0)])


@SETTINGS
@given(case=files, length_lie=st.sampled_from([0, 0, 0, 0, 1, -1, 2**63]))
def test_fuzzed_adapter_files_raise_only_shuttle_errors(tmp_path_factory, case, length_lie):
    raw, body = case
    path = tmp_path_factory.getbasetemp() / f"fuzz{next(_names)}.safetensors"
    path.write_bytes(struct.pack("<Q", (len(raw) + length_lie) % 2**64) + raw + body)
    try:
        check(path)
    finally:
        path.unlink()
