"""``shuttle.integrations.cast``: a float32 release written once in the dtypes its model computes
in (a tiny WanPipeline, whose norms diffusers keeps in float32, and a tiny Llama), against the
original loaded in that dtype: the same model bit for bit, and under a host ceiling the copy
streams from disk where the original is refused.
"""

from __future__ import annotations

import json

import pytest
import torch

from shuttle.errors import (
    AdapterFileError,
    BudgetTooSmallError,
    InvalidOptionError,
    ShuttleError,
)
from shuttle.formats.safetensors_file import SafetensorsFile
from shuttle.integrations.cast import cast
from tests.integrations.models import run_wan, tiny_llama, tiny_wan

pytest.importorskip("diffusers")


@pytest.fixture(autouse=True)
def _cpu_copy(cpu_copy):
    """Every test here activates on the CPU through the copy path."""


@pytest.fixture(scope="module")
def wan32(tmp_path_factory):
    """A tiny WanPipeline saved in float32, its weights off the bfloat16 grid (so that a cast
    rounds them)."""
    folder = tmp_path_factory.mktemp("wan") / "f32"
    pipe = tiny_wan().to(torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in (pipe.transformer, pipe.text_encoder, pipe.vae):
            for p in module.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)
    pipe.save_pretrained(folder)
    return folder


def weights(folder) -> dict[str, torch.dtype]:
    """``component/tensor`` -> dtype of every weight file tensor of a pipeline folder."""
    return {f"{p.parent.name}/{k}": f.tensor_ref(k).dtype
            for p in sorted(folder.glob("*/*.safetensors")) for f in [SafetensorsFile(p)]
            for k in f}


def file_bytes(folder) -> int:
    return sum(f.tensor_ref(k).nbytes for p in folder.glob("*/*.safetensors")
               for f in [SafetensorsFile(p)] for k in f)


def test_a_float32_pipeline_cast_loads_as_the_original_and_streams_from_disk(wan32, tmp_path,
                                                                            monkeypatch):
    from diffusers import DiffusionPipeline

    from shuttle.integrations import diffusers as shuttle_diffusers

    monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", 4096)
    monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", 4096)
    report = cast(wan32, tmp_path / "bf16", torch.bfloat16, progress=False)
    copy = report.out
    ref = DiffusionPipeline.from_pretrained(wan32, torch_dtype=torch.bfloat16)
    # every tensor in the dtype diffusers gives its parameter; the float32-kept ones stay
    want = {f"{c}/{n}": t.dtype for c in ("transformer", "text_encoder", "vae")
            for n, t in getattr(ref, c).state_dict().items()}
    got = weights(copy)
    assert {k: got[k] for k in want if k in got} == {k: want[k] for k in got if k in want}
    assert torch.float32 in got.values() and torch.bfloat16 in got.values()
    assert report.cast == sum(d == torch.bfloat16 for d in got.values())
    assert report.bytes_after < report.bytes_before
    budget = file_bytes(copy) // 3
    with pytest.raises(BudgetTooSmallError, match="shuttle cast"):
        shuttle_diffusers.from_pretrained(wan32, torch_dtype=torch.bfloat16, device="cpu",
                                          vram_budget=600_000, max_host_bytes=budget)
    pipe, handle = shuttle_diffusers.from_pretrained(copy, torch_dtype=torch.bfloat16,
                                                     device="cpu", vram_budget=600_000,
                                                     prefetch=1, max_host_bytes=budget)
    assert any(u.on_disk for u in handle.offloaders["transformer"].storage.groups["blocks"])
    assert torch.equal(run_wan(pipe), run_wan(ref))
    handle.remove()


def test_a_sharded_transformers_model_casts_and_its_index_counts_the_new_bytes(tmp_path):
    pytest.importorskip("transformers")
    from shuttle.integrations import transformers as shuttle_transformers

    model = tiny_llama()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    model.save_pretrained(tmp_path / "f32", max_shard_size="20KB")
    assert len(list((tmp_path / "f32").glob("*.safetensors"))) > 2
    cast(tmp_path / "f32", tmp_path / "bf16", "bfloat16", progress=False)
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    shards = [SafetensorsFile(p) for p in (tmp_path / "bf16").glob("*.safetensors")]
    assert index["metadata"]["total_size"] == sum(f.tensor_ref(k).nbytes for f in shards
                                                  for k in f)
    assert all(f.tensor_ref(k).dtype == torch.bfloat16 for f in shards for k in f)
    got, h1 = shuttle_transformers.from_pretrained(tmp_path / "bf16", torch_dtype=torch.bfloat16,
                                                   device="cpu")
    want, h2 = shuttle_transformers.from_pretrained(tmp_path / "f32", torch_dtype=torch.bfloat16,
                                                    device="cpu")
    ids = torch.tensor([[3, 14, 15, 9, 26]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)
    h1.remove()
    h2.remove()


def test_bad_targets_and_folders_are_refused_and_nothing_is_written(wan32, tmp_path):
    with pytest.raises(AdapterFileError, match="inside it"):
        cast(wan32, wan32 / "copy", progress=False)
    (tmp_path / "taken").mkdir()
    with pytest.raises(AdapterFileError, match="overwrite=True"):
        cast(wan32, tmp_path / "taken", progress=False)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("no model here")
    with pytest.raises(AdapterFileError, match="neither a diffusers pipeline"):
        cast(tmp_path / "plain", tmp_path / "out", progress=False)
    for bad in (None, "int8", torch.int8):
        with pytest.raises(InvalidOptionError):
            cast(wan32, tmp_path / "out", bad, progress=False)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "taken"]


def test_a_compressed_folder_is_refused(tmp_path):
    from shuttle.weights.lossless_file import compress_folder

    model = tiny_llama().to(torch.bfloat16)
    model.save_pretrained(tmp_path / "plain")
    compress_folder(tmp_path / "plain", tmp_path / "coded", progress=False)
    with pytest.raises(ShuttleError, match="shuttle compress"):
        cast(tmp_path / "coded", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_cast_that_fails_midway_leaves_no_folder(wan32, tmp_path, monkeypatch):
    from shuttle.integrations import cast as cast_module

    done = []

    def failing(*args):
        if done:
            raise OSError("disk full")
        done.append(1)
        return original(*args)
    original = cast_module._cast_file
    monkeypatch.setattr(cast_module, "_cast_file", failing)
    with pytest.raises(OSError, match="disk full"):
        cast(wan32, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its partial copy
