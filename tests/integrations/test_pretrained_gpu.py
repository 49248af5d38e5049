"""``from_pretrained`` on the GPU: mid-size bf16 models written with ``save_pretrained`` and
built straight from their files (pinned arenas filled by one read of each tensor) give the
outputs of the same files loaded by diffusers / transformers and run resident, bit for bit,
and the load's peak host memory is the weights once.

Attention runs on the flash or math kernels (see test_e2e_gpu.py: cuDNN's is not
deterministic on Hopper).
"""

from __future__ import annotations

import pytest
import torch

from shuttle.integrations import diffusers as shuttle_diffusers
from shuttle.integrations import transformers as shuttle_transformers
from tests.integrations import host_peak
from tests.integrations.models import midsize_flux, midsize_llama, run_midsize_flux

pytestmark = pytest.mark.gpu
pytest.importorskip("diffusers")

GIB = 2**30


@pytest.fixture(scope="module", autouse=True)
def deterministic_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        yield


def weight_bytes(handle) -> int:
    return sum(o.storage.weight_bytes for o in handle.offloaders.values())


def check_pinned_once(handle, peak: dict[str, int]) -> None:
    """Every arena page-locked, arenas of the weights' size, the load's RSS the weights once."""
    weights = weight_bytes(handle)
    storages = [o.storage for o in handle.offloaders.values()]
    assert all(s.pinned for s in storages)
    assert sum(s.host_bytes for s in storages) <= 1.01 * weights
    assert peak["bytes"] <= 1.05 * weights + 64 * 2**20, (peak, weights)


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    """(folder of a mid-size bf16 FluxPipeline, the pixels of the same files loaded by diffusers
    and run resident)."""
    from diffusers import DiffusionPipeline

    folder = tmp_path_factory.mktemp("flux")
    midsize_flux().save_pretrained(folder, max_shard_size="500MB")
    resident = DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16).to("cuda")
    ref = run_midsize_flux(resident)
    assert torch.equal(run_midsize_flux(resident), ref)  # deterministic
    del resident
    torch.cuda.empty_cache()
    return folder, ref


@pytest.mark.parametrize("share", [None, 0.6])
def test_flux_from_its_files_is_the_resident_pipeline(flux_folder, share):
    folder, ref = flux_folder
    transformer = sum(p.stat().st_size for p in (folder / "transformer").glob("*.safetensors"))
    budget = None if share is None else int(share * transformer)
    torch.cuda.init()  # the CUDA context is no part of the load's host memory
    with host_peak() as peak:
        pipe, handle = shuttle_diffusers.from_pretrained(
            folder, torch_dtype=torch.bfloat16, vram_budget=budget, device="cuda")
    check_pinned_once(handle, peak)
    assert len(list((folder / "transformer").glob("*.safetensors"))) > 1  # sharded
    for _ in range(2):
        assert torch.equal(run_midsize_flux(pipe), ref)
    plan = handle.offloaders["transformer"].plan
    assert budget is None or plan.device_bytes <= budget
    handle.remove()


def test_a_float8_flux_streams_its_float8_bytes_and_equals_diffusers_widened_load(
        flux_folder, tmp_path):
    """The transformer's 2-D weights rewritten in float8_e4m3fn (an fp8 release): shuttle keeps
    them float8 (the Triton cast as each module runs) under a VRAM budget and a host ceiling
    that sends blocks to disk; diffusers widens them at load and runs resident."""
    import shutil

    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "fp8"
    shutil.copytree(flux_folder[0], folder)
    files = sorted((folder / "transformer").glob("*.safetensors"))
    for f in files:
        save_file({k: t.to(torch.float8_e4m3fn) if t.dim() == 2 else t
                   for k, t in load_file(f).items()}, f, metadata={"format": "pt"})
    resident = DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16).to("cuda")
    ref = run_midsize_flux(resident)
    del resident
    torch.cuda.empty_cache()
    fp8 = sum(f.stat().st_size for f in files)
    pipe, handle = shuttle_diffusers.from_pretrained(
        folder, torch_dtype=torch.bfloat16, vram_budget=int(0.6 * fp8), device="cuda",
        max_host_bytes=int(0.5 * sum(p.stat().st_size for p in folder.glob("*/*.safetensors"))))
    for _ in range(2):
        assert torch.equal(run_midsize_flux(pipe), ref)
    storage = handle.offloaders["transformer"].storage
    assert storage.weight_bytes <= 0.6 * weight_bytes_of(flux_folder[0] / "transformer")
    assert storage.reader is not None and storage.reader.bytes_read > 0
    handle.remove()


def weight_bytes_of(folder) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """(folder of a mid-size bf16 Llama in shards, the logits of the same files loaded by
    transformers and run resident, its greedy tokens)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    midsize_llama().save_pretrained(folder, max_shard_size="1GB")
    resident = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    ids = torch.arange(3, 203).remainder(32000).unsqueeze(0).cuda() * 7 % 32000
    with torch.no_grad():
        logits = resident(ids).logits
        tokens = resident.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    del resident
    torch.cuda.empty_cache()
    return folder, ids, logits, tokens


@pytest.mark.parametrize("budget", [None, 2 * GIB])
def test_llama_from_its_files_is_the_resident_model(llama_folder, budget):
    folder, ids, logits, tokens = llama_folder
    torch.cuda.init()
    with host_peak() as peak:
        model, handle = shuttle_transformers.from_pretrained(folder, vram_budget=budget,
                                                             device="cuda", prefetch=1)
    check_pinned_once(handle, peak)
    assert model.dtype == torch.bfloat16 and model.device == torch.device("cuda")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0),
                       tokens)
    plan = handle.offloaders["model"].plan  # active still: stays for the next call
    assert budget is None or plan.device_bytes <= budget
    handle.remove()


def test_auto_budgets_take_what_the_device_and_host_have_free(llama_folder):
    from shuttle.integrations.budgets import VRAM_RESERVE
    from shuttle.offload.host_memory import HOST_RESERVE, available_host_bytes

    folder, ids, logits, tokens = llama_folder
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    available = available_host_bytes()
    model, handle = shuttle_transformers.from_pretrained(folder, vram_budget="auto",
                                                         max_host_bytes="auto", device="cuda")
    assert abs(handle._vram_budget - (free - max(VRAM_RESERVE, free // 10))) < 2**28
    assert abs(handle.cache.max_bytes - (available - HOST_RESERVE)) < 2 * GIB
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    handle.remove()
