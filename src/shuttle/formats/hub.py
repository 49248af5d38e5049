"""Adapters named by a Hugging Face Hub repo id: ``load_lora("user/repo", weight_name=...)``.

A source that is no local path but reads as ``owner/name`` is fetched with ``huggingface_hub``
(when installed) into its cache, and read from there like any file. Without ``weight_name``, the
repo's one ``.safetensors`` file is taken, or diffusers' ``pytorch_lora_weights.safetensors``
when there are several. Every error says first that no local file or folder of that name exists
(a mistyped path reads as a repo id too).

Offline (``HF_HUB_OFFLINE=1``), or when the Hub's host does not answer a quick connection (no
proxy configured), only the local cache is read: the Hub client would otherwise retry for about
half a minute before failing. Errors of the Hub client are caught by kind whatever its version
(``requests`` before 1.0, ``httpx`` after; no HTTP library is imported here).
"""

from __future__ import annotations

import re
import socket
import urllib.request
from pathlib import Path
from types import ModuleType
from urllib.parse import urlsplit

from shuttle.errors import AdapterFileError, MissingDependencyError
from shuttle.optional import import_optional

__all__ = ["DIFFUSERS_WEIGHT_NAME", "hub_file", "looks_like_repo_id"]

DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json")
# Packages whose exceptions mean the request did not get an answer (huggingface_hub 2.x wraps
# httpx as httpx2): timeouts, refused connections, DNS failures.
_TRANSPORT_PACKAGES = ("httpx", "httpx2", "httpcore", "requests", "urllib3")
_PROBE_SECONDS = 3.0


def looks_like_repo_id(source: str) -> bool:
    """Whether ``source`` reads as ``owner/name`` and is no local path or adapter file name."""
    return (bool(_REPO_ID.match(source)) and not source.endswith(_FILE_SUFFIXES)
            and not Path(source).exists())


def hub_file(repo_id: str, weight_name: str | None = None) -> str:
    """The local path of ``weight_name`` of Hub repo ``repo_id``, downloaded if needed.

    Raises:
        MissingDependencyError: ``huggingface_hub`` is not installed.
        AdapterFileError: no such repo or file, several candidate files and no
            ``weight_name``, or the Hub unreachable and the file not cached. The message
            starts with ``no local file or folder '<repo_id>' exists``.
    """
    no_path = f"no local file or folder {repo_id!r} exists"
    try:
        hub = import_optional("huggingface_hub", "the Hugging Face Hub",
                              "pip install huggingface_hub")
        errors = import_optional("huggingface_hub.errors", "the Hugging Face Hub",
                                 "pip install huggingface_hub")
        constants = import_optional("huggingface_hub.constants", "the Hugging Face Hub",
                                    "pip install huggingface_hub")
    except MissingDependencyError as e:
        raise MissingDependencyError(
            f"{no_path}, and reading it as a Hugging Face Hub repo id needs huggingface_hub "
            f"({e}); check the path, or install it, or download the file and pass its path"
        ) from None
    unreachable = "HF_HUB_OFFLINE is set" if _offline(constants) else \
        _unreachable_because(constants)
    if unreachable is not None:
        return _cached(hub, errors, repo_id, weight_name, no_path, unreachable)
    try:
        if weight_name is None:
            weight_name = _only_weights(repo_id, hub.list_repo_files(repo_id), no_path)
        return hub.hf_hub_download(repo_id, weight_name)
    except AdapterFileError:  # an OSError too: ours, from _only_weights
        raise
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as e:
        raise AdapterFileError(
            f"{no_path}, and the Hub has no repo of that name this machine can read "
            f"({type(e).__name__}); check the path or the repo id, or log in for a private or "
            "gated repo"
        ) from None
    except errors.LocalEntryNotFoundError as e:  # a subclass of EntryNotFoundError: first
        raise _not_reached(repo_id, weight_name, no_path, _reason(e)) from None
    except errors.EntryNotFoundError:  # the remote one is an OSError too: before OSError
        raise AdapterFileError(
            f"{no_path}, and Hub repo {repo_id!r} has no file {weight_name!r}; pass the file's "
            "name in the repo as weight_name="
        ) from None
    except Exception as e:
        if _is_transport_error(e):
            raise _not_reached(repo_id, weight_name, no_path, _reason(e)) from None
        if isinstance(e, ValueError):  # HFValidationError: "a/b..c" reads as a repo id here
            raise AdapterFileError(f"{no_path}, and it is no valid Hub repo id ({e})") from None
        raise


def _offline(constants: ModuleType) -> bool:
    is_offline = getattr(constants, "is_offline_mode", None)
    return bool(is_offline() if callable(is_offline) else getattr(constants, "HF_HUB_OFFLINE",
                                                                   False))


def _unreachable_because(constants: ModuleType) -> str | None:
    """Why the Hub's host cannot be reached, from one quick connection; None when it answers,
    or when a proxy is configured (the Hub client goes through it, this check would not).
    """
    endpoint = urlsplit(getattr(constants, "ENDPOINT", "https://huggingface.co"))
    scheme, host = endpoint.scheme or "https", endpoint.hostname
    if host is None or _proxied(scheme, host):
        return None
    port = endpoint.port or (443 if scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=_PROBE_SECONDS).close()
    except OSError as e:
        return f"cannot connect to {host}:{port} ({e.strerror or e or type(e).__name__})"
    return None


def _proxied(scheme: str, host: str) -> bool:
    proxies = urllib.request.getproxies()
    return bool(proxies.get(scheme) or proxies.get("all")) and not \
        urllib.request.proxy_bypass(host)


def _cached(hub: ModuleType, errors: ModuleType, repo_id: str, weight_name: str | None,
            no_path: str, unreachable: str) -> str:
    """The file from the local cache alone (the Hub cannot be asked)."""
    try:
        if weight_name is None:
            snapshot = Path(hub.snapshot_download(repo_id, local_files_only=True))
            files = [p.relative_to(snapshot).as_posix() for p in sorted(snapshot.rglob("*"))
                     if p.is_file()]
            weight_name = _only_weights(repo_id, files, no_path)
        return hub.hf_hub_download(repo_id, weight_name, local_files_only=True)
    except AdapterFileError:
        raise
    except (errors.LocalEntryNotFoundError, OSError, ValueError):
        raise _not_reached(repo_id, weight_name, no_path,
                           f"{unreachable}, and the file is not in the local cache") from None


def _is_transport_error(e: BaseException) -> bool:
    """An exception of an HTTP library (or an OSError: requests' ConnectionError, the Hub's
    OfflineModeIsEnabled and HTTP errors): the request got no usable answer.
    """
    return isinstance(e, OSError) or any(
        cls.__module__.split(".")[0] in _TRANSPORT_PACKAGES for cls in type(e).__mro__)


def _reason(e: BaseException) -> str:
    """``e`` in a few words, with the connection error under a Hub error if there is one."""
    cause = e.__cause__ or e.__context__
    shown = cause if cause is not None and _is_transport_error(cause) else e
    text = str(shown).strip().splitlines()[0] if str(shown).strip() else ""
    return f"{type(shown).__name__}: {text}" if text else type(shown).__name__


def _not_reached(repo_id: str, weight_name: str | None, no_path: str,
                 why: str) -> AdapterFileError:
    where = f"{repo_id} {weight_name}" if weight_name else repo_id
    return AdapterFileError(
        f"{no_path}, and the Hub could not be reached: {why}. If it is a path, check its "
        f"spelling; if it is a repo id, download the file where the Hub is reachable "
        f"(hf download {where}) and pass its path, or retry online"
    )


def _only_weights(repo_id: str, files: list[str], no_path: str) -> str:
    """The repo's adapter file when ``weight_name`` is not given."""
    weights = [f for f in files if f.endswith(".safetensors")]
    if len(weights) == 1:
        return weights[0]
    if DIFFUSERS_WEIGHT_NAME in weights:
        return DIFFUSERS_WEIGHT_NAME
    listed = ", ".join(weights[:8]) + (" ..." if len(weights) > 8 else "")
    raise AdapterFileError(
        f"{no_path}, and Hub repo {repo_id!r} holds {len(weights)} .safetensors files "
        f"({listed or 'none'}); pass the one to read as weight_name="
    )

