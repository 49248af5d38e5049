"""open_checkpoint: one file, shards, an index, a directory or a dict; headers only."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from shuttle.errors import AdapterFileError, CheckpointError, CorruptFileError
from shuttle.formats.model_checkpoint import open_checkpoint
from shuttle.formats.safetensors_file import LazyTensor


def _write(tmp_path):
    save_file({"a.weight": torch.ones(2, 3), "a.bias": torch.zeros(2)},
              str(tmp_path / "m-1.safetensors"))
    save_file({"b.weight": torch.full((4,), 2.0)}, str(tmp_path / "m-2.safetensors"))
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a.weight": "m-1.safetensors",
                                                "a.bias": "m-1.safetensors",
                                                "b.weight": "m-2.safetensors"}}))
    return index


def test_every_form_gives_the_same_lazy_tensors(tmp_path):
    index = _write(tmp_path)
    forms = [index, tmp_path, [tmp_path / "m-1.safetensors", tmp_path / "m-2.safetensors"]]
    for form in forms:
        ckpt = open_checkpoint(form)
        assert sorted(ckpt.tensors) == ["a.bias", "a.weight", "b.weight"]
        assert all(isinstance(t, LazyTensor) for t in ckpt.tensors.values())
        assert torch.equal(ckpt.tensors["b.weight"].load(), torch.full((4,), 2.0))
    assert open_checkpoint(tmp_path / "m-1.safetensors").name == "m-1.safetensors"
    assert open_checkpoint({"x": torch.ones(1)}).name == "<state dict>"


def test_bad_sources(tmp_path):
    index = _write(tmp_path)
    with pytest.raises(CheckpointError, match="more than one"):
        open_checkpoint([tmp_path / "m-1.safetensors", tmp_path / "m-1.safetensors"])
    with pytest.raises(CheckpointError, match="not"):
        open_checkpoint({"x": [1, 2]})
    with pytest.raises(AdapterFileError):
        open_checkpoint([])
    with pytest.raises(AdapterFileError, match="no such file"):
        open_checkpoint(tmp_path / "gone.safetensors")
    with pytest.raises(AdapterFileError, match="convert"):
        (tmp_path / "m.bin").write_bytes(b"")
        open_checkpoint(tmp_path / "m.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterFileError, match="no \\*.safetensors"):
        open_checkpoint(tmp_path / "empty")
    index.write_text(json.dumps({"weight_map": {"a.weight": "m-2.safetensors"}}))
    with pytest.raises(CorruptFileError, match="does not hold it"):
        open_checkpoint(index)
    index.write_text("{not json")
    with pytest.raises(CorruptFileError, match="JSON"):
        open_checkpoint(index)


def test_a_lazy_tensor_reads_a_row_range_alone(tmp_path):
    """``load_rows``: the rows' bytes only (a rank's row shard), equal to the slice; a range
    outside the tensor is a typed error."""
    from shuttle.errors import ShuttleError

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(13, 5, 3, generator=g).to(torch.bfloat16),
               "v": torch.randn(7, generator=g), "s": torch.tensor(1.5)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    ckpt = open_checkpoint(tmp_path / "m.safetensors")
    for key, (a, b) in {"w": (3, 9), "v": (6, 7)}.items():
        rows = ckpt.tensors[key].load_rows(a, b)
        assert torch.equal(rows, tensors[key][a:b])
    assert ckpt.tensors["w"].load_rows(4, 4).shape == (0, 5, 3)
    for key, (a, b) in {"w": (9, 14), "v": (3, 2), "s": (0, 1)}.items():
        with pytest.raises(ShuttleError, match="row range"):
            ckpt.tensors[key].load_rows(a, b)
