"""Compressed checkpoints: written valid safetensors, read back to the original bits, damage
refused with typed errors; ``shuttle compress`` and ``shuttle inspect`` on them.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import shuttle
from shuttle.cli import main
from shuttle.errors import AdapterFileError, CorruptCodeError, CorruptFileError, ShuttleError
from shuttle.kernels import exponent_decode
from shuttle.weights.lossless_file import (
    LOSSLESS_KEY,
    CodedRef,
    compress_file,
    open_decoded,
)
from tests import assert_bits_equal


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setattr(exponent_decode, "interpreting", lambda: False)  # CPU: the reference


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(256, 160, bias=False).to(torch.bfloat16)  # 40960 values: coded
        self.half = nn.Linear(256, 200).to(torch.float16)  # 51200 values: coded
        self.small = nn.Linear(8, 8).to(torch.bfloat16)  # too small to gain
        self.norm = nn.LayerNorm(8)  # float32: kept
        self.register_buffer("steps", torch.arange(5))  # int64: kept


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.02)
    return {k: v.contiguous() for k, v in net.state_dict().items()}


@pytest.fixture
def files(tmp_path):
    state = _state()
    src = tmp_path / "model.safetensors"
    save_file(state, str(src), metadata={"origin": "test"})
    out = tmp_path / "model.lossless.safetensors"
    report = compress_file(src, out, progress=False)
    return state, src, out, report


def test_compressed_file_is_safetensors_and_decodes_to_the_same_bits(files):
    state, _, out, report = files
    assert (report.tensors, report.coded) == (len(state), 2)  # big.weight, half.weight
    raw = load_file(str(out))  # other tools open it: the coded tensors are U8 blobs
    assert raw["big.weight"].dtype == torch.uint8 and raw["norm.weight"].dtype == torch.float32
    ckpt = open_decoded(out)
    assert ckpt.metadata == {"origin": "test"}
    assert isinstance(ckpt.tensors["big.weight"], CodedRef)
    for k, v in state.items():
        ref = ckpt.tensors[k]
        got = ref.load()
        assert got.shape == v.shape and got.dtype == v.dtype
        assert_bits_equal(got, v, k)
    assert report.stored_bytes < report.raw_bytes and report.ratio < 0.9


def test_load_checkpoint_reads_a_compressed_file_exactly(files):
    state, _, out, _ = files
    with torch.device("meta"):
        net = Net()
    shuttle.load_checkpoint(net, out, device="cpu")
    for k, v in net.state_dict().items():
        assert_bits_equal(v, state[k], k)


def test_a_damaged_blob_is_refused_naming_the_tensor(files, tmp_path):
    _, _, out, _ = files
    data = bytearray(out.read_bytes())
    raw = load_file(str(out))
    blob = raw["big.weight"].numpy().tobytes()
    at = data.find(blob[9000:9064])  # inside the blob's raw bytes or code words
    assert at > 0
    data[at + 3] ^= 0x10
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptCodeError, match="big.weight"):
        open_decoded(bad).tensors["big.weight"].load()


def test_malformed_metadata_is_refused(tmp_path):
    state = _state()
    for meta, match in [("{", "malformed"),
                        # version 1 stored the lookup table in peek order
                        (json.dumps({"version": 1, "lanes": 128, "steps": 256, "max_len": 12,
                                     "tensors": {}}), "compress the original again"),
                        (json.dumps({"version": 2, "lanes": 256, "steps": 256, "max_len": 12,
                                     "tensors": {}}), "layout"),
                        (json.dumps({"version": 2, "lanes": 128, "steps": 256, "max_len": 12,
                                     "tensors": {"big.weight": {"dtype": "BF16",
                                                                "shape": [160, 256],
                                                                "words": 10}}}), "U8 tensor")]:
        path = tmp_path / "m.safetensors"
        save_file(state, str(path), metadata={LOSSLESS_KEY: meta})
        with pytest.raises(CorruptFileError, match=match):
            open_decoded(path)


def test_compress_refuses_what_it_cannot_do(files, tmp_path):
    _, src, out, _ = files
    with pytest.raises(AdapterFileError, match="exists"):
        compress_file(src, out, progress=False)
    with pytest.raises(AdapterFileError, match="overwrite the input"):
        compress_file(src, src, overwrite=True, progress=False)
    with pytest.raises(ShuttleError, match="compressed already"):
        compress_file(out, tmp_path / "again.safetensors", progress=False)
    compress_file(src, out, overwrite=True, progress=False)  # --force


def test_cli_compress_and_inspect(tmp_path, capsys):
    state = _state()
    src = tmp_path / "in.safetensors"
    save_file(state, str(src))
    out = tmp_path / "out.safetensors"
    assert main(["compress", str(src), str(out), "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["coded"] == 2 and written["ratio"] < 1
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["coded"] == 2 and info["stored_bytes"] == written["stored_bytes"]
    assert info["coded_ratio"] < 0.9
    assert main(["compress", str(src), str(out)]) == 2  # exists: a one-line error
    assert "exists" in capsys.readouterr().err


def test_a_folder_is_compressed_file_by_file_and_the_rest_copied(tmp_path, capsys):
    from shuttle.weights.lossless_file import compress_folder

    src = tmp_path / "model"
    (src / "transformer").mkdir(parents=True)
    state = _state()
    save_file(state, str(src / "transformer" / "model.safetensors"))
    save_file({"plain": torch.arange(6.0)}, str(src / "extra.safetensors"))
    (src / "model_index.json").write_text('{"_class_name": "X"}')
    (src / "transformer" / "config.json").write_text("{}")
    (src / "linked.json").symlink_to(src / "model_index.json")  # as a Hub cache snapshot
    out = tmp_path / "coded"
    reports = compress_folder(src, out, progress=False)
    assert [r.path for r in reports] == [out / "extra.safetensors",
                                         out / "transformer" / "model.safetensors"]
    assert [r.coded for r in reports] == [0, 2]
    for name in ("model_index.json", "transformer/config.json", "linked.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
        assert not (out / name).is_symlink()
    got = open_decoded(out / "transformer" / "model.safetensors")
    for name, t in state.items():
        assert_bits_equal(got.tensors[name].load(), t, name)
    assert not list(tmp_path.glob(".*part"))
    with pytest.raises(AdapterFileError, match="exists"):
        compress_folder(src, out, progress=False)
    with pytest.raises(AdapterFileError, match="inside it"):
        compress_folder(src, src / "coded", progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(AdapterFileError, match="is a file"):
        compress_folder(src, tmp_path / "file", overwrite=True, progress=False)
    with pytest.raises(AdapterFileError, match="not a folder"):
        compress_folder(src / "transformer" / "config.json", tmp_path / "x", progress=False)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "config.json").write_text("{}")
    with pytest.raises(AdapterFileError, match="no .safetensors"):
        compress_folder(tmp_path / "configs", tmp_path / "x", progress=False)
    # the CLI takes a folder too
    assert main(["compress", str(src), str(out), "--force", "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["files"] == 2 and written["coded"] == 2 and written["ratio"] < 1


def test_a_folder_whose_file_fails_leaves_nothing_behind(tmp_path):
    from shuttle.weights.lossless_file import compress_folder

    src = tmp_path / "model"
    src.mkdir()
    save_file(_state(), str(src / "a.safetensors"))
    compress_file(src / "a.safetensors", src / "b.safetensors", progress=False)  # coded already
    with pytest.raises(ShuttleError, match="compressed already"):
        compress_folder(src, tmp_path / "coded", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
