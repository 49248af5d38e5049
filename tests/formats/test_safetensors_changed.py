"""An adapter file changed after load_lora: the next read raises FileChangedError, never SIGBUS.

A loaded adapter reads its tensors from the file only at a merge (through a map of it, or with
pread). A file made shorter would kill the process with SIGBUS when a mapped page past its new
end is touched; one rewritten in place would merge other bytes without a word.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import shuttle
from shuttle.errors import AdapterFileError, FileChangedError
from shuttle.formats.safetensors_file import SafetensorsFile

OUT, IN, RANK = 64, 64, 16  # 4 KiB factors: the data spans several pages


def adapter(path, seed=0) -> None:
    g = torch.Generator().manual_seed(seed)
    save_file({"lora_unet_lin.lora_down.weight": torch.randn(RANK, IN, generator=g),
               "lora_unet_lin.lora_up.weight": torch.randn(OUT, RANK, generator=g),
               "lora_unet_lin.alpha": torch.tensor(float(RANK))}, str(path))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT)


def bump_mtime(path, seconds=10) -> None:
    """A later modification time, even where the clock is coarser than the rewrite."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


def truncate(path):
    os.truncate(path, 100)


def rewrite_same_size(path):
    st = os.stat(path)
    adapter(path, seed=1)  # other values, the same header: the same size
    assert os.stat(path).st_size == st.st_size
    bump_mtime(path)


def replace(path):
    other = path.with_name("other.safetensors")
    adapter(other, seed=1)
    os.replace(other, path)  # a new inode under the same name


def delete(path):
    os.remove(path)


CHANGES = [truncate, rewrite_same_size, replace, delete]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__)
def test_merge_after_the_file_changed_raises_and_leaves_the_model(tmp_path, change):
    path = tmp_path / "a.safetensors"
    adapter(path)
    lora = shuttle.load_lora(path)
    change(path)
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(FileChangedError, match="a.safetensors") as e:
        shuttle.merge_lora(model, [(lora, 1.0)])
    assert "again" in str(e.value)
    assert isinstance(e.value, AdapterFileError)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_the_same_size_rewrite_is_caught_by_mtime_alone(tmp_path):
    """Same inode, same size, only the modification time tells: it must be enough."""
    path = tmp_path / "a.safetensors"
    adapter(path)
    f = SafetensorsFile(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    with open(path, "r+b") as out:  # in place: the inode stays
        out.write(data)
    bump_mtime(path, seconds=1)
    with pytest.raises(FileChangedError, match="modification time"):
        f.read("lora_unet_lin.lora_up.weight")


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("how", ["map", "copy", "into"])
def test_every_read_path_checks_after_an_earlier_read(tmp_path, change, how):
    path = tmp_path / "a.safetensors"
    adapter(path)
    f = SafetensorsFile(path)
    key = "lora_unet_lin.lora_up.weight"
    first = f.read(key).clone()  # the map exists now
    assert torch.equal(SafetensorsFile(path).read(key, copy=True), first)
    change(path)
    with pytest.raises(FileChangedError):
        if how == "into":
            f.read_into(key, torch.empty(OUT * RANK * 4, dtype=torch.uint8))
        else:
            f.read(key, copy=how == "copy")


def test_a_mapped_file_made_shorter_does_not_kill_the_process(tmp_path):
    """In a child process: without the check, the read below dies of SIGBUS."""
    path = tmp_path / "a.safetensors"
    adapter(path)
    script = textwrap.dedent(f"""
        import os
        from shuttle.errors import FileChangedError
        from shuttle.formats.safetensors_file import SafetensorsFile
        f = SafetensorsFile({str(path)!r})
        f.read("lora_unet_lin.lora_down.weight").sum()  # maps the file
        os.truncate({str(path)!r}, 100)
        try:
            print(f.read("lora_unet_lin.lora_up.weight").sum())
        except FileChangedError:
            print("refused")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, f"child died: returncode {run.returncode}, {run.stderr[-2000:]}"
    assert run.stdout.strip() == "refused"


def test_an_unchanged_file_reads_after_it_was_touched(tmp_path):
    """Reading it (atime) or opening it again is no change."""
    path = tmp_path / "a.safetensors"
    adapter(path)
    lora = shuttle.load_lora(path)
    path.read_bytes()
    SafetensorsFile(path)
    report = shuttle.merge_lora(Net(), [(lora, 1.0)])
    assert len(report.applied) == 1
