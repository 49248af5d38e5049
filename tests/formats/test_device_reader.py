"""Staged reads: ``read_into`` a reused buffer on the CPU; DeviceReader onto CUDA."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from shuttle.formats.device_reader import DeviceReader
from shuttle.formats.safetensors_file import SafetensorsFile


@pytest.fixture
def file(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(33, 7, generator=g).bfloat16(), "b": torch.randn(5, generator=g),
          "c": torch.arange(11, dtype=torch.int16), "empty": torch.zeros(0, 4)}
    save_file(sd, str(tmp_path / "t.safetensors"))
    return SafetensorsFile(tmp_path / "t.safetensors"), sd


def test_read_into_one_reused_buffer(file):
    f, sd = file
    buf = torch.full((1024,), 0xAB, dtype=torch.uint8)
    for key, want in sd.items():
        got = f.tensor_ref(key).load_into(buf)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
        assert got.numel() == 0 or got.data_ptr() == buf.data_ptr()  # no copy of its own


def test_read_into_rejects_a_small_or_typed_buffer(file):
    f, _ = file
    with pytest.raises(ValueError, match="at least 462 bytes"):
        f.read_into("a", torch.empty(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        f.read_into("a", torch.empty(1024, dtype=torch.float32))


def test_device_reader_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        DeviceReader(torch.device("cpu"))


@pytest.mark.gpu
def test_device_reader_matches_the_file(file):
    f, sd = file
    reader = DeviceReader(torch.device("cuda"))
    out = {k: reader.read(f.tensor_ref(k)) for k in [*sd, *sd]}  # every buffer reused
    for k, want in sd.items():
        assert out[k].is_cuda and torch.equal(out[k].cpu(), want)


def test_reads_split_into_pieces_read_the_same_bytes(file, monkeypatch):
    import shuttle.formats.safetensors_file as sf

    f, sd = file
    monkeypatch.setattr(sf, "_READ_PIECE", 8)  # "a" (462 bytes) becomes pieces on the pool
    monkeypatch.setattr(sf, "_READERS", 3)
    buf = torch.empty(1024, dtype=torch.uint8)
    for key, want in sd.items():
        assert torch.equal(f.read(key, copy=True), want)
        assert torch.equal(f.read_into(key, buf), want)
