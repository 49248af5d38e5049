"""Integration tests. ``host_peak``: the process's peak resident memory over a block;
``fake_hub``: ``huggingface_hub.snapshot_download`` serving a local folder."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import shutil
from collections.abc import Iterator


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


@contextlib.contextmanager
def host_peak() -> Iterator[dict[str, int]]:
    """Yield a dict whose ``"bytes"`` is set, at the block's end, to the process's peak resident
    memory inside the block above what was resident at its start (Linux only).

    Memory freed before the block goes back to the system first (``malloc_trim``), so the
    block cannot hide an allocation in pages that were freed but still resident; the kernel's
    peak (``VmHWM``) is then restarted from the resident size (``clear_refs``).
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS:")
    out = {"bytes": 0}
    yield out
    out["bytes"] = _status("VmHWM:") - base


def fake_hub(monkeypatch, repo, fetched):
    """``huggingface_hub.snapshot_download`` serving ``repo`` (a folder) as ``owner/repo``:
    it copies the files its patterns select into one snapshot folder, as the Hub's cache does,
    and records them in ``fetched``."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    snapshot = repo.parent / "snapshot"

    def snapshot_download(repo_id, *, revision=None, allow_patterns=None, ignore_patterns=None):
        assert repo_id == "owner/repo" and revision == "v1"
        files = [str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file()]
        for f in filter_repo_objects(files, allow_patterns=allow_patterns,
                                     ignore_patterns=ignore_patterns):
            (snapshot / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / f, snapshot / f)
            fetched.add(f)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
