"""``shuttle.integrations.diffusers.from_pretrained``: a tiny FluxPipeline saved with
``save_pretrained`` and built back straight from its files.

The pipeline saved is the reference: its own outputs, bit for bit (CPU copy mode keeps every
bit). diffusers' own ``from_pretrained`` is the reference for dtypes; its weights are views of
the mapped files at unaligned addresses, on which the CPU GEMM rounds differently, so its
outputs are compared after its tensors are copied into aligned memory.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shuttle.errors import (
    AdapterFileError,
    CacheError,
    DeviceUnavailableError,
    HostMemoryError,
    InvalidOptionError,
    OffloadError,
)
from shuttle.formats.safetensors_file import SafetensorsFile
from shuttle.integrations import diffusers as shuttle_diffusers
from tests.integrations.models import flux_lora, run_flux, run_wan, tiny_flux, tiny_wan

pytest.importorskip("diffusers")

MODULES = ("transformer", "text_encoder", "text_encoder_2", "vae")


@pytest.fixture(autouse=True)
def _cpu_copy(cpu_copy):
    """Every test here activates on the CPU through the copy path."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folders by layout: one file per component / sharded, the saved pipeline's latents and
    pixels)."""
    root = tmp_path_factory.mktemp("flux")
    pipe = tiny_flux()
    pipe.save_pretrained(root / "single")
    pipe.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert len(list((root / "sharded" / "transformer").glob("*.safetensors"))) > 2
    return {"single": root / "single", "sharded": root / "sharded"}, run_flux(pipe), \
        run_flux(pipe, "pt")


def reads(monkeypatch) -> list[tuple[str, int, int]]:
    """(file, begin, end) of every byte range read from a safetensors file from now on."""
    calls: list[tuple[str, int, int]] = []
    original = SafetensorsFile._read_copy

    def recorded(self, begin, end, raw=None):
        calls.append((str(self.path), begin, end))
        return original(self, begin, end, raw)

    monkeypatch.setattr(SafetensorsFile, "_read_copy", recorded)
    return calls


def file_bytes(folder) -> int:
    """Bytes of the tensors in every safetensors file of the pipeline folder."""
    return sum(f.tensor_ref(k).nbytes for p in folder.glob("*/*.safetensors")
               for f in [SafetensorsFile(p)] for k in f)


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("vram_budget", [None, 400_000])
def test_outputs_equal_the_saved_pipeline_and_every_byte_is_read_once(saved, layout,
                                                                      vram_budget, monkeypatch):
    folders, latents, pixels = saved
    calls = reads(monkeypatch)
    pipe, handle = shuttle_diffusers.from_pretrained(folders[layout], device="cpu",
                                                     vram_budget=vram_budget, prefetch=1)
    assert type(pipe).__name__ == "FluxPipeline"
    # One read of each tensor's bytes, nothing read twice, no component left on meta.
    assert sum(end - begin for _, begin, end in calls) == file_bytes(folders[layout])
    assert len(calls) == len(set(calls))
    for name in MODULES:
        module = getattr(pipe, name)
        assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()]), name
    storages = [o.storage for o in handle.offloaders.values()]
    assert sorted(handle.offloaders) == sorted(MODULES)
    # Arenas of exactly the weights (16-byte alignment between tensors): no other host copy.
    assert sum(s.host_bytes for s in storages) <= 1.01 * file_bytes(folders[layout])
    assert list(handle.offloaders["transformer"].blocks) == ["transformer_blocks",
                                                             "single_transformer_blocks"]
    assert torch.equal(run_flux(pipe), latents)
    assert torch.equal(run_flux(pipe, "pt"), pixels)
    handle.remove()
    assert all(p.is_meta for p in pipe.transformer.parameters())  # given back empty


def aligned(pipe):
    """``pipe`` with every tensor of its modules copied into memory of its own (aligned)."""
    with torch.no_grad():
        for name in MODULES:
            for t in [*getattr(pipe, name).parameters(), *getattr(pipe, name).buffers()]:
                t.data = t.data.clone()
    return pipe


def dtypes(pipe) -> dict[str, torch.dtype]:
    return {f"{n}.{k}": t.dtype for n in MODULES
            for k, t in [*getattr(pipe, n).named_parameters(),
                         *getattr(pipe, n).named_buffers()]}


@pytest.mark.parametrize(("stored", "asked"), [(torch.float32, torch.bfloat16),
                                               (torch.bfloat16, None),
                                               (torch.bfloat16, torch.float32)])
def test_torch_dtype_converts_while_reading_as_diffusers_loads(tmp_path, stored, asked):
    from diffusers import DiffusionPipeline

    tiny_flux().to(stored).save_pretrained(tmp_path)
    ref = aligned(DiffusionPipeline.from_pretrained(tmp_path, dtype=asked))
    pipe, handle = shuttle_diffusers.from_pretrained(tmp_path, torch_dtype=asked, device="cpu")
    assert dtypes(pipe) == dtypes(ref)
    if asked is None:  # diffusers models float32, transformers models as their config says
        assert pipe.transformer.dtype == torch.float32
        assert pipe.text_encoder_2.dtype == torch.bfloat16
        # (a pipeline of mixed dtypes: diffusers' own cannot run it either)
    else:
        assert torch.equal(run_flux(pipe, "pt"), run_flux(ref, "pt"))
    handle.remove()


def test_modules_diffusers_keeps_in_float32_stay_float32(tmp_path, monkeypatch):
    from diffusers import DiffusionPipeline, FluxTransformer2DModel

    tiny_flux().save_pretrained(tmp_path)
    monkeypatch.setattr(FluxTransformer2DModel, "_keep_in_fp32_modules", ["norm_out", "proj_out"])
    ref = DiffusionPipeline.from_pretrained(tmp_path, dtype=torch.bfloat16)
    pipe, handle = shuttle_diffusers.from_pretrained(tmp_path, torch_dtype=torch.bfloat16,
                                                     device="cpu")
    assert pipe.transformer.proj_out.weight.dtype == torch.float32
    assert pipe.transformer.x_embedder.weight.dtype == torch.bfloat16
    assert dtypes(pipe) == dtypes(ref)
    handle.remove()


def test_components_given_are_used_as_given(saved):
    folders, latents, _ = saved
    own = tiny_flux()
    scheduler = type(own.scheduler).from_config(own.scheduler.config)
    pipe, handle = shuttle_diffusers.from_pretrained(folders["single"], device="cpu",
                                                     vae=own.vae, scheduler=scheduler)
    assert pipe.vae is own.vae and pipe.scheduler is scheduler
    assert torch.equal(run_flux(pipe), latents)
    handle.remove()
    assert not any(p.is_meta for p in own.vae.parameters())  # its own tensors, back in place


def test_a_folder_without_a_pipeline_or_weights_is_refused(saved, tmp_path):
    folders, _, _ = saved
    with pytest.raises(AdapterFileError, match="no model_index.json"):
        shuttle_diffusers.from_pretrained(folders["single"] / "transformer", device="cpu")
    with pytest.raises(AdapterFileError, match="no such folder"):
        shuttle_diffusers.from_pretrained(tmp_path / "nowhere", device="cpu")
    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps(
        {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    src = folders["single"] / "transformer"
    (tmp_path / "transformer" / "config.json").write_text((src / "config.json").read_text())
    (tmp_path / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"")
    with pytest.raises(AdapterFileError, match=r"only diffusion_pytorch_model\.bin"):
        shuttle_diffusers.from_pretrained(tmp_path, device="cpu")


def test_a_missing_device_is_refused_before_the_files_are_looked_at(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailableError):
        shuttle_diffusers.from_pretrained(tmp_path / "nowhere", device="cuda")


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"torch_dtype": "bf8"}, InvalidOptionError),
    ({"torch_dtype": torch.int64}, InvalidOptionError),
    ({"vram_budget": "4 GiB VRAM"}, OffloadError), ({"vram_budget": True}, OffloadError),
    ({"max_host_bytes": "-8GiB"}, CacheError)])
def test_bad_arguments_are_refused_before_the_files_are_looked_at(tmp_path, kwargs, error):
    with pytest.raises(error):
        shuttle_diffusers.from_pretrained(tmp_path / "nowhere", device="cpu", **kwargs)


def test_torch_dtype_and_budgets_by_name(tmp_path):
    tiny_flux().save_pretrained(tmp_path)
    named, handle = shuttle_diffusers.from_pretrained(
        tmp_path, torch_dtype="bf16", vram_budget="400kB", max_host_bytes="1 GiB", device="cpu")
    assert handle._vram_budget == 400_000 and handle._cache.max_bytes == 2**30
    out = run_flux(named, "pt")
    handle.remove()
    pipe, handle = shuttle_diffusers.from_pretrained(tmp_path, torch_dtype=torch.bfloat16,
                                                     device="cpu")
    assert dtypes(named) == dtypes(pipe) and pipe.transformer.dtype == torch.bfloat16
    assert torch.equal(out, run_flux(pipe, "pt"))
    handle.remove()


def test_no_ceiling_past_the_memory_available_is_refused_and_auto_fits(saved, monkeypatch):
    """Without max_host_bytes the pipeline's weights must fit in what this machine has
    available (refused before any weight is read, naming "auto"); "auto" holds what fits."""
    from shuttle.integrations import budgets
    from shuttle.offload.host_memory import HOST_RESERVE

    monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", 4096)
    monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", 4096)
    folders, latents, _ = saved
    room = file_bytes(folders["single"]) // 3
    monkeypatch.setattr(budgets, "available_host_bytes", lambda: HOST_RESERVE + room)
    calls = reads(monkeypatch)
    with pytest.raises(HostMemoryError, match="max_host_bytes='auto'"):
        shuttle_diffusers.from_pretrained(folders["single"], device="cpu")
    assert not calls
    pipe, handle = shuttle_diffusers.from_pretrained(folders["single"], device="cpu",
                                                     max_host_bytes="auto")
    assert handle._cache.max_bytes == room
    assert torch.equal(run_flux(pipe), latents)
    assert sum(o.storage.host_bytes for o in handle.offloaders.values()) <= room
    handle.remove()


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    """A tiny Flux pipeline in bfloat16 whose transformer's file stores every 2-D weight in
    float8_e4m3fn (as fp8 checkpoints do), and the latents diffusers' own loading gives."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("fp8")
    tiny_flux().to(torch.bfloat16).save_pretrained(folder)
    (file,) = (folder / "transformer").glob("*.safetensors")
    state = {k: t.to(torch.float8_e4m3fn) if t.dim() == 2 else t
             for k, t in load_file(file).items()}
    save_file(state, file, metadata={"format": "pt"})
    ref = DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16)  # widens at load
    return folder, run_flux(ref), run_flux(ref, "pt")


@pytest.mark.parametrize("host", [None, "disk"])
def test_float8_weights_are_kept_as_stored_and_compute_in_torch_dtype(fp8_folder, monkeypatch,
                                                                      host):
    from diffusers import FluxTransformer2DModel

    monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", 4096)
    monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", 4096)
    folder, latents, pixels = fp8_folder
    ceiling = file_bytes(folder) // 2 if host == "disk" else None
    pipe, handle = shuttle_diffusers.from_pretrained(
        folder, torch_dtype=torch.bfloat16, device="cpu", max_host_bytes=ceiling, prefetch=1)
    t = pipe.transformer
    assert t.transformer_blocks[0].attn.to_q.weight.dtype == torch.float8_e4m3fn  # as stored
    assert t.transformer_blocks[0].attn.to_q.bias.dtype == torch.bfloat16  # stored in bf16
    assert t.dtype == torch.bfloat16  # what the pipeline casts its inputs to
    assert torch.equal(run_flux(pipe), latents)  # bit-identical to diffusers' widened load
    assert torch.equal(run_flux(pipe, "pt"), pixels)
    storage = handle.offloaders["transformer"].storage
    if host == "disk":
        assert storage.reader.bytes_read > 0  # float8 bytes streamed from the file
    handle.remove()
    assert type(t) is FluxTransformer2DModel and t.transformer_blocks[0].attn.to_q.weight.is_meta
    widened, handle = shuttle_diffusers.from_pretrained(folder, torch_dtype="bf16", device="cpu",
                                                        float8="widen")
    assert widened.transformer.transformer_blocks[0].attn.to_q.weight.dtype == torch.bfloat16
    assert torch.equal(run_flux(widened), latents)
    widened_bytes = handle.offloaders["transformer"].storage.host_bytes
    handle.remove()
    if host is None:
        assert storage.host_bytes < widened_bytes  # float8 weights: fewer bytes held


def test_a_dynamic_adapter_on_kept_float8_weights_equals_it_on_widened_ones(fp8_folder):
    folder, _, _ = fp8_folder
    outs = []
    for float8 in ("keep", "widen"):
        pipe, handle = shuttle_diffusers.from_pretrained(folder, torch_dtype=torch.bfloat16,
                                                         device="cpu", float8=float8)
        handle.set_loras([(flux_lora(), 0.8)], mode="dynamic")
        outs.append(run_flux(pipe))
        handle.remove()
    assert torch.equal(*outs)


def test_an_unknown_float8_choice_is_refused(tmp_path):
    with pytest.raises(InvalidOptionError, match="float8='fp8'"):
        shuttle_diffusers.from_pretrained(tmp_path, device="cpu", float8="fp8")


def test_variant_files_beside_the_weights_are_not_read(saved, tmp_path, monkeypatch):
    folders, latents, _ = saved
    shutil.copytree(folders["single"], tmp_path, dirs_exist_ok=True)
    vae = tmp_path / "vae"
    (vae / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"not read")
    (vae / "diffusion_pytorch_model.safetensors.index.fp16.json").write_text("not read")
    pipe, handle = shuttle_diffusers.from_pretrained(tmp_path, device="cpu")
    assert torch.equal(run_flux(pipe), latents)
    handle.remove()


def test_attention_blocks_saved_under_their_old_names_load(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    folders, _, pixels = saved
    shutil.copytree(folders["single"], tmp_path, dirs_exist_ok=True)
    path = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    old = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    tensors = load_file(path)
    renamed = {}
    for k, v in tensors.items():
        for new, before in old.items():
            k = k.replace(f".attentions.0.{new}.", f".attentions.0.{before}.")
        renamed[k] = v
    assert "decoder.mid_block.attentions.0.query.weight" in renamed
    save_file(renamed, path, metadata={"format": "pt"})
    pipe, handle = shuttle_diffusers.from_pretrained(tmp_path, device="cpu")
    assert torch.equal(run_flux(pipe, "pt"), pixels)
    handle.remove()


@pytest.mark.parametrize("vram_budget", [None, 400_000])
def test_a_host_budget_far_below_the_pipeline_reads_the_rest_from_disk(saved, monkeypatch,
                                                                      vram_budget):
    # Staging buffers of one page, so that a pipeline of a few hundred kB has a disk tier.
    monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", 4096)
    monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", 4096)
    folders, latents, pixels = saved
    budget = file_bytes(folders["sharded"]) // 3
    pipe, handle = shuttle_diffusers.from_pretrained(folders["sharded"], device="cpu",
                                                     vram_budget=vram_budget, prefetch=1,
                                                     max_host_bytes=budget)
    storages = [o.storage for o in handle.offloaders.values()]
    shares = {n: (c.share, c.host_floor) for n, c in handle._components.items()}
    # The denoiser, read at every step, is first in line for host memory: the text encoders
    # (streamed too under a VRAM budget) stay at their floors while it does not fit whole.
    assert shares["transformer"][0] > shares["transformer"][1]
    assert all(share == floor for n, (share, floor) in shares.items() if n != "transformer")
    for _ in range(2):
        assert torch.equal(run_flux(pipe), latents)
        assert sum(s.host_bytes for s in storages) <= budget
    assert torch.equal(run_flux(pipe, "pt"), pixels)
    assert sum(s.reader.bytes_read for s in storages if s.reader is not None) > 0
    handle.remove()


def test_modules_kept_in_float32_beside_bfloat16_files_stream_from_disk(tmp_path, monkeypatch):
    # Wan's blocks hold norms and a scale-shift table that diffusers keeps in float32 while
    # the folder stores them in bfloat16: converted once and held beside each block, the
    # rest of which is still read from the files at every step.
    from diffusers import DiffusionPipeline

    monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", 4096)
    monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", 4096)
    tiny_wan().save_pretrained(tmp_path)
    ref = DiffusionPipeline.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    assert ref.transformer.blocks[0].scale_shift_table.dtype == torch.float32
    budget = file_bytes(tmp_path) // 3
    pipe, handle = shuttle_diffusers.from_pretrained(tmp_path, torch_dtype=torch.bfloat16,
                                                     device="cpu", vram_budget=600_000,
                                                     prefetch=1, max_host_bytes=budget)
    blocks = handle.offloaders["transformer"].storage.groups["blocks"]
    assert all(u.side for u in blocks) and any(u.on_disk for u in blocks)
    assert all(t.dtype == torch.float32 for u in blocks for t in u.side.values())
    for _ in range(2):
        assert torch.equal(run_wan(pipe), run_wan(ref))
        assert sum(o.storage.host_bytes for o in handle.offloaders.values()) <= budget
    handle.remove()


def test_a_float32_folder_asked_in_bfloat16_under_a_small_ceiling_says_what_to_do(saved):
    from shuttle.errors import BudgetTooSmallError

    folders, _, _ = saved  # float32 files: converted while read, held in host memory
    with pytest.raises(BudgetTooSmallError, match="another dtype.*shuttle cast"):
        shuttle_diffusers.from_pretrained(folders["single"], torch_dtype=torch.bfloat16,
                                          device="cpu",
                                          max_host_bytes=file_bytes(folders["single"]) // 8)


@pytest.fixture(scope="module")
def bf16_folders(tmp_path_factory):
    """A tiny pipeline saved in bfloat16 (what `shuttle compress` codes; its transformer wide
    enough that coding its tensors pays), and a copy of that folder with every weight file
    written by `shuttle compress`."""
    from shuttle.weights.lossless_file import compress_folder

    root = tmp_path_factory.mktemp("flux-bf16")
    tiny_flux(head_dim=64, heads=4, axes=(16, 24, 24)).to(torch.bfloat16).save_pretrained(
        root / "plain")
    compress_folder(root / "plain", root / "coded", progress=False)
    return root / "plain", root / "coded"


def test_a_compressed_folder_streams_from_disk_with_fewer_bytes_read(bf16_folders,
                                                                    monkeypatch):
    # A pipeline folder whose files `shuttle compress` wrote, under a host ceiling: the units
    # left on disk are read coded (about 0.7x the bytes), the outputs the plain folder's.
    from shuttle.kernels import exponent_decode

    monkeypatch.setattr(exponent_decode, "interpreting", lambda: False)  # CPU: the reference
    monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", 4096)
    monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", 4096)
    budget = file_bytes(bf16_folders[0]) // 2
    read, outs = {}, {}
    for folder in bf16_folders:
        pipe, handle = shuttle_diffusers.from_pretrained(
            folder, torch_dtype=torch.bfloat16, device="cpu", prefetch=1,
            vram_budget=24_000_000, max_host_bytes=budget)
        storages = [o.storage for o in handle.offloaders.values()]
        outs[folder.name] = run_flux(pipe), run_flux(pipe, "pt")
        read[folder.name] = sum(s.reader.bytes_read for s in storages if s.reader is not None)
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(outs["plain"], outs["coded"], strict=True))
    assert 0 < read["coded"] < 0.8 * read["plain"]


def test_a_budget_below_a_compressed_folders_floor_raises_and_changes_nothing(bf16_folders):
    # Coded units need staging on the device, so the floor is higher than the plain folder's;
    # below it the refusal is the typed error (cleaning up must not trip over units still
    # coded on disk).
    from shuttle.errors import BudgetTooSmallError

    plain, coded = bf16_folders
    budgets = {"vram_budget": 9_000_000, "max_host_bytes": file_bytes(plain) // 2}
    pipe, handle = shuttle_diffusers.from_pretrained(plain, torch_dtype=torch.bfloat16,
                                                     device="cpu", **budgets)
    handle.remove()
    with pytest.raises(BudgetTooSmallError, match="staging for coded weights"):
        shuttle_diffusers.from_pretrained(coded, torch_dtype=torch.bfloat16, device="cpu",
                                          **budgets)
