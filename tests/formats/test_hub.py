"""load_lora("owner/name"): a Hub repo id read through huggingface_hub (mocked: no network).

The Hub client's functions are replaced by fakes that return files or raise the exceptions the
real clients raise (huggingface_hub's own, and its HTTP library's: httpx2 in 2.x, httpx in 1.x,
requests before); the quick connection to the Hub's host is replaced too.
"""

from __future__ import annotations

import importlib
import importlib.util
import socket
import sys
import urllib.request

import pytest
import torch
from safetensors.torch import save_file

import shuttle
from shuttle.errors import AdapterFileError, MissingDependencyError
from shuttle.formats.hub import looks_like_repo_id

hub = pytest.importorskip("huggingface_hub")
errors = pytest.importorskip("huggingface_hub.errors")
constants = pytest.importorskip("huggingface_hub.constants")


def _adapter(path):
    save_file({"layer.lora_A.weight": torch.ones(2, 4), "layer.lora_B.weight": torch.ones(3, 2)},
              str(path))
    return path


def _http_error(cls):
    """An instance of one of huggingface_hub's HTTP errors (its __init__ wants a response)."""
    e = cls.__new__(cls)
    Exception.__init__(e, cls.__name__)
    return e


def _probe(answer: OSError | None, calls: list | None = None):
    """A ``socket.create_connection`` that records its address and fails with ``answer``."""
    class Connection:
        def close(self):
            pass

    def create_connection(address, timeout=None):
        if calls is not None:
            calls.append(address)
        if answer is not None:
            raise answer
        return Connection()

    return create_connection


@pytest.fixture(autouse=True)
def online(monkeypatch):
    """The Hub's host answers the quick connection, no proxy, not offline (override below)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(urllib.request, "getproxies", dict)
    monkeypatch.setattr(socket, "create_connection", _probe(None))


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

    def hf_hub_download(repo_id, filename, local_files_only=False):
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
    ("owner/missing", {}, "the Hub has no repo of that name this machine can read"),
    ("owner/style", {"weight_name": "nope.safetensors"}, "has no file 'nope.safetensors'"),
])
def test_a_missing_repo_or_file_names_it(fake_hub, source, kwargs, why):
    with pytest.raises(AdapterFileError, match=why) as e:
        shuttle.load_lora(source, **kwargs)
    assert str(e.value).startswith(f"no local file or folder {source!r} exists, and ")


def test_an_id_the_hub_refuses_is_typed(monkeypatch):
    def list_repo_files(repo_id):  # as the client's argument check raises it
        raise errors.HFValidationError("Cannot have -- or .. in repo_id: 'owner/b..c'.")

    monkeypatch.setattr(hub, "list_repo_files", list_repo_files)
    with pytest.raises(AdapterFileError, match=r"^no local file or folder 'owner/b\.\.c' "
                                               "exists, and it is no valid Hub repo id"):
        shuttle.load_lora("owner/b..c")


def _client_errors() -> dict[str, BaseException]:
    """What each client version raises when the Hub cannot be reached (the installed HTTP
    libraries' real classes; httpx 1.x's stood in for by a class of that module if absent).
    """
    out: dict[str, BaseException] = {}
    for package in ("httpx2", "httpx"):
        if importlib.util.find_spec(package) is not None:
            out[package] = importlib.import_module(package).ConnectError(
                "[Errno -2] Name or service not known")
    if "httpx" not in out:
        out["httpx"] = type("ConnectError", (Exception,), {"__module__": "httpx"})(
            "[Errno -2] Name or service not known")
    requests = importlib.import_module("requests") if importlib.util.find_spec("requests") \
        else None
    if requests is not None:
        out["requests"] = requests.exceptions.ConnectionError("Max retries exceeded")
    try:  # hf_hub_download in 2.x: the connection error, then this from it
        raise errors.LocalEntryNotFoundError("cannot find the requested files") from \
            next(iter(out.values()))
    except errors.LocalEntryNotFoundError as e:
        out["hub-local-entry"] = e
    out["hub-offline"] = errors.OfflineModeIsEnabled("HF_HUB_OFFLINE=1")
    out["timeout"] = TimeoutError("timed out")
    return out


CLIENT_ERRORS = _client_errors()


@pytest.mark.parametrize("name", CLIENT_ERRORS)
@pytest.mark.parametrize("weight_name", [None, "x.safetensors"])
def test_every_clients_connection_error_is_typed(monkeypatch, name, weight_name):
    error = CLIENT_ERRORS[name]

    def down(*args, **kwargs):
        raise error

    monkeypatch.setattr(hub, "list_repo_files", down)
    monkeypatch.setattr(hub, "hf_hub_download", down)
    with pytest.raises(AdapterFileError) as e:
        shuttle.load_lora("owner/style", weight_name=weight_name)
    message = str(e.value)
    assert message.startswith(
        "no local file or folder 'owner/style' exists, and the Hub could not be reached: "), \
        message
    shown = error.__cause__ if name == "hub-local-entry" else error
    assert f"{type(shown).__name__}: {str(shown).splitlines()[0]}" in message
    assert f"hf download owner/style{' ' + weight_name if weight_name else ''}" in message


@pytest.fixture
def cache_only(monkeypatch, tmp_path):
    """A Hub client whose cache holds ``owner/style``'s diffusers file; asking the Hub fails
    the test. Returns the cached file.
    """
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    cached = _adapter(snapshot / "pytorch_lora_weights.safetensors")

    def hf_hub_download(repo_id, filename, local_files_only=False):
        assert local_files_only, "asked the Hub"
        if repo_id != "owner/style" or filename != cached.name:
            raise errors.LocalEntryNotFoundError("not in the cache")
        return str(cached)

    def snapshot_download(repo_id, local_files_only=False):
        assert local_files_only, "asked the Hub"
        if repo_id != "owner/style":
            raise errors.LocalEntryNotFoundError("not in the cache")
        return str(snapshot)

    def list_repo_files(repo_id):
        raise AssertionError("asked the Hub")

    monkeypatch.setattr(hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(hub, "list_repo_files", list_repo_files)
    return cached


@pytest.mark.parametrize("weight_name", [None, "pytorch_lora_weights.safetensors"])
def test_an_unreachable_host_reads_the_cache_without_asking_the_hub(monkeypatch, cache_only,
                                                                    weight_name):
    """The client would retry for about 23 s: the quick connection fails, so it is not asked."""
    calls = []
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.example:8443")
    monkeypatch.setattr(socket, "create_connection", _probe(
        socket.gaierror(-2, "Name or service not known"), calls))
    lora = shuttle.load_lora("owner/style", weight_name=weight_name)
    assert lora.source == str(cache_only) and calls == [("hub.example", 8443)]
    with pytest.raises(AdapterFileError) as e:
        shuttle.load_lora("owner/other", weight_name=weight_name)
    assert str(e.value).startswith(
        "no local file or folder 'owner/other' exists, and the Hub could not be reached: cannot "
        "connect to hub.example:8443 (Name or service not known), and the file is not in the "
        "local cache."), str(e.value)


def test_offline_mode_reads_the_cache_without_connecting(monkeypatch, cache_only):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(socket, "create_connection", _probe(AssertionError("connected")))
    assert shuttle.load_lora("owner/style").source == str(cache_only)
    with pytest.raises(AdapterFileError, match="could not be reached: HF_HUB_OFFLINE is set, "
                                               "and the file is not in the local cache"):
        shuttle.load_lora("owner/other", weight_name="x.safetensors")


def test_through_a_proxy_the_hub_is_asked(monkeypatch, fake_hub):
    repo, calls = fake_hub
    monkeypatch.setattr(urllib.request, "getproxies", lambda: {"https": "http://proxy:3128"})
    monkeypatch.setattr(socket, "create_connection", _probe(AssertionError("connected")))
    shuttle.load_lora("owner/style")
    assert calls == [("owner/style", "pytorch_lora_weights.safetensors")]


def test_without_huggingface_hub_the_missing_path_comes_first(monkeypatch):
    for name in ("huggingface_hub", "huggingface_hub.errors", "huggingface_hub.constants"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingDependencyError) as e:
        shuttle.load_lora("loras/style")
    assert str(e.value).startswith("no local file or folder 'loras/style' exists, and reading "
                                   "it as a Hugging Face Hub repo id needs huggingface_hub")


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
