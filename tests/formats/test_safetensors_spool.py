"""SafetensorsSpool: tensors spooled as they come, published atomically, readable by safetensors."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from shuttle.formats.safetensors_file import SafetensorsFile
from shuttle.formats.safetensors_spool import SafetensorsSpool


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 5, generator=g).bfloat16(),  # odd byte count before wider dtypes
        "b": torch.randn(7, generator=g),
        "c": torch.tensor(4.0, dtype=torch.float64),
        "d": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "e": torch.empty(0, 4),
    }


def test_publish_round_trips_through_both_readers(tmp_path):
    tensors = _tensors()
    out = tmp_path / "x.safetensors"
    with SafetensorsSpool(tmp_path) as spool:
        for k, v in tensors.items():
            spool.add(k, v)
        assert torch.equal(spool.read("a"), tensors["a"])
        assert spool.publish(out, {"who": "test"}) == out
    ref = load_file(str(out))  # the reference implementation accepts the layout
    ours = SafetensorsFile(out)
    assert ours.metadata == {"who": "test"}
    for k, v in tensors.items():
        assert ref[k].dtype == v.dtype and torch.equal(ref[k], v)
        assert torch.equal(ours.read(k), v)
    assert os.listdir(tmp_path) == ["x.safetensors"]  # the spool is anonymous


def test_failed_check_keeps_the_old_file(tmp_path):
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"old")
    seen = []

    def check(path):
        seen.append(SafetensorsFile(path).keys())  # complete and readable before the rename
        raise RuntimeError("rejected")

    with SafetensorsSpool(tmp_path) as spool:
        spool.add("a", torch.ones(2))
        with pytest.raises(RuntimeError, match="rejected"):
            spool.publish(out, check=check)
    assert seen == [["a"]]
    assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["x.safetensors"]
