"""load_lora("owner/name"): a Hub repo id read through huggingface_hub (mocked: no network)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import shuttle
from shuttle.errors import AdapterFileError
from shuttle.formats.hub import looks_like_repo_id

hub = pytest.importorskip("huggingface_hub")
errors = pytest.importorskip("huggingface_hub.errors")


def _adapter(path):
    save_file({"layer.lora_A.weight": torch.ones(2, 4), "layer.lora_B.weight": torch.ones(3, 2)},
              str(path))
    return path


def _http_error(cls):
    """An instance of one of huggingface_hub's HTTP errors (its __init__ wants a response)."""
    e = cls.__new__(cls)
    Exception.__init__(e, cls.__name__)
    return e


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """A Hub holding ``owner/style`` with the given files; records the downloads."""
    repo = {"pytorch_lora_weights.safetensors": _adapter(tmp_path / "a.safetensors"),
            "other.safetensors": _adapter(tmp_path / "b.safetensors"), "README.md": None}
    calls = []

    def list_repo_files(repo_id):
        if repo_id != "owner/style":
            raise _http_error(errors.RepositoryNotFoundError)
        return list(repo)

    def hf_hub_download(repo_id, filename):
        calls.append((repo_id, filename))
        if filename not in repo:
            raise _http_error(errors.RemoteEntryNotFoundError)
        return str(repo[filename])

    monkeypatch.setattr(hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(hub, "hf_hub_download", hf_hub_download)
    return repo, calls


def test_a_repo_id_reads_the_named_file(fake_hub):
    repo, calls = fake_hub
    lora = shuttle.load_lora("owner/style", weight_name="other.safetensors")
    assert calls == [("owner/style", "other.safetensors")]
    assert lora.source == str(repo["other.safetensors"])


def test_without_weight_name_the_diffusers_file_is_taken(fake_hub):
    repo, calls = fake_hub
    shuttle.load_lora("owner/style")
    assert calls == [("owner/style", "pytorch_lora_weights.safetensors")]


@pytest.mark.parametrize(("source", "kwargs", "why"), [
    ("owner/missing", {}, "neither a local path nor a Hugging Face repo"),
    ("owner/style", {"weight_name": "nope.safetensors"}, "has no file 'nope.safetensors'"),
])
def test_a_missing_repo_or_file_names_it(fake_hub, source, kwargs, why):
    with pytest.raises(AdapterFileError, match=why):
        shuttle.load_lora(source, **kwargs)


@pytest.mark.parametrize("error", [
    lambda: errors.LocalEntryNotFoundError("not cached"),
    lambda: errors.OfflineModeIsEnabled("HF_HUB_OFFLINE=1"), lambda: ConnectionError("down")])
def test_offline_and_not_cached_says_how_to_download(monkeypatch, error):
    def offline(*args, **kwargs):
        raise error()

    monkeypatch.setattr(hub, "hf_hub_download", offline)
    with pytest.raises(AdapterFileError, match="hf download owner/style x.safetensors"):
        shuttle.load_lora("owner/style", weight_name="x.safetensors")


def test_several_files_and_none_named_asks_for_weight_name(monkeypatch):
    monkeypatch.setattr(hub, "list_repo_files", lambda repo_id: ["a.safetensors", "b.safetensors"])
    with pytest.raises(AdapterFileError, match="holds 2 .safetensors files"):
        shuttle.load_lora("owner/two")


def test_local_paths_win_and_weight_name_joins_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner" / "style").mkdir(parents=True)
    _adapter(tmp_path / "owner" / "style" / "x.safetensors")
    assert not looks_like_repo_id("owner/style")  # a local directory of that name
    lora = shuttle.load_lora("owner/style", weight_name="x.safetensors")
    assert lora.source.endswith("x.safetensors")
    assert not looks_like_repo_id("loras/style.safetensors")  # a file name, missing or not
    with pytest.raises(AdapterFileError):
        shuttle.load_lora("loras/style.safetensors")
    with pytest.raises(AdapterFileError, match="weight_name"):
        shuttle.load_lora({"layer.lora_A.weight": torch.ones(2, 4)}, weight_name="x")
