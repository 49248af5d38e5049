"""Adapters named by a Hugging Face Hub repo id: ``load_lora("user/repo", weight_name=...)``.

A source that is no local path but reads as ``owner/name`` is fetched with ``huggingface_hub``
(when installed) into its cache, and read from there like any file. Without ``weight_name``, the
repo's one ``.safetensors`` file is taken, or diffusers' ``pytorch_lora_weights.safetensors``
when there are several. Offline, a file already in the cache is used; anything else raises an
error saying how to download it.
"""

from __future__ import annotations

import re
from pathlib import Path

from shuttle.errors import AdapterFileError
from shuttle.optional import import_optional

__all__ = ["DIFFUSERS_WEIGHT_NAME", "hub_file", "looks_like_repo_id"]

DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json")


def looks_like_repo_id(source: str) -> bool:
    """Whether ``source`` reads as ``owner/name`` and is no local path or adapter file name."""
    return (bool(_REPO_ID.match(source)) and not source.endswith(_FILE_SUFFIXES)
            and not Path(source).exists())


def hub_file(repo_id: str, weight_name: str | None = None) -> str:
    """The local path of ``weight_name`` of Hub repo ``repo_id``, downloaded if needed.

    Raises:
        MissingDependencyError: ``huggingface_hub`` is not installed.
        AdapterFileError: no such repo or file, several candidate files and no
            ``weight_name``, or the Hub is unreachable and the file is not cached.
    """
    hub = import_optional("huggingface_hub", f"reading {repo_id!r} from the Hugging Face Hub "
                          "(or download the file and pass its path)", "pip install huggingface_hub")
    errors = import_optional("huggingface_hub.errors", "the Hugging Face Hub",
                             "pip install huggingface_hub")
    try:
        if weight_name is None:
            weight_name = _only_weights(repo_id, hub.list_repo_files(repo_id))
        return hub.hf_hub_download(repo_id, weight_name)
    except AdapterFileError:  # an OSError too: ours, from _only_weights
        raise
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as e:
        raise AdapterFileError(
            f"{repo_id!r} is neither a local path nor a Hugging Face repo this machine can "
            f"read ({type(e).__name__}); check the name, or log in for a private or gated repo"
        ) from None
    except errors.LocalEntryNotFoundError as e:  # a subclass of EntryNotFoundError: first
        raise _unreachable(repo_id, weight_name, e) from None
    except errors.EntryNotFoundError:  # the remote one is an OSError too: before OSError
        raise AdapterFileError(
            f"{repo_id!r} has no file {weight_name!r}; pass the file's name in the repo as "
            "weight_name="
        ) from None
    except OSError as e:  # offline mode, connection errors
        raise _unreachable(repo_id, weight_name, e) from None


def _unreachable(repo_id: str, weight_name: str | None, e: Exception) -> AdapterFileError:
    where = f"{repo_id} {weight_name}" if weight_name else repo_id
    return AdapterFileError(
        f"{repo_id!r}: the Hugging Face Hub cannot be reached and the file is not in the local "
        f"cache ({type(e).__name__}); download it where the Hub is reachable "
        f"(hf download {where}) and pass its path, or retry online"
    )


def _only_weights(repo_id: str, files: list[str]) -> str:
    """The repo's adapter file when ``weight_name`` is not given."""
    weights = [f for f in files if f.endswith(".safetensors")]
    if len(weights) == 1:
        return weights[0]
    if DIFFUSERS_WEIGHT_NAME in weights:
        return DIFFUSERS_WEIGHT_NAME
    listed = ", ".join(weights[:8]) + (" ..." if len(weights) > 8 else "")
    raise AdapterFileError(
        f"{repo_id!r} holds {len(weights)} .safetensors files ({listed or 'none'}); pass the "
        "one to read as weight_name="
    )
