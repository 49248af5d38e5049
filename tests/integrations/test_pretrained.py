"""What both ``from_pretrained`` share (``shuttle.integrations.pretrained``): parameters built on
``meta`` with real buffers, Hub repos fetched with only the files needed, and the host memory
a load takes (the weights once, measured as the process's peak resident memory).
"""

from __future__ import annotations

import math
import shutil
import sys

import pytest
import torch

from shuttle.errors import AdapterFileError
from shuttle.integrations.pretrained import meta_parameters
from tests.integrations import fake_hub, host_peak
from tests.integrations.models import run_flux, tiny_flux, tiny_llama

pytest.importorskip("transformers")


class WithBuffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("inv_freq", 1.0 / 10 ** torch.arange(0, 4, 2).float(),
                             persistent=False)
        self.scale = torch.nn.Parameter(torch.ones(3), requires_grad=False)
        tagged = torch.nn.Parameter(torch.ones(2))
        tagged.tag = "kept"
        self.tagged = tagged


def test_meta_parameters_puts_parameters_on_meta_and_keeps_buffers_real():
    with meta_parameters():
        m = WithBuffers()
    assert all(p.is_meta for p in m.parameters())
    assert type(m.linear.weight) is torch.nn.Parameter and not m.scale.requires_grad
    assert m.tagged.tag == "kept" and m.tagged.requires_grad
    assert torch.equal(m.inv_freq, torch.tensor([1.0, 0.01]))
    assert not any(p.is_meta for p in WithBuffers().parameters())  # only inside the block


def test_meta_parameters_restores_registration_after_an_error():
    with pytest.raises(RuntimeError, match="boom"), meta_parameters():
        raise RuntimeError("boom")
    assert not torch.nn.Linear(2, 2).weight.is_meta


def test_a_hub_pipeline_fetches_only_its_components_safetensors(tmp_path, monkeypatch,
                                                                 cpu_copy):
    from shuttle.integrations import diffusers as shuttle_diffusers

    pytest.importorskip("diffusers")
    ref = tiny_flux()
    repo = tmp_path / "repo"
    ref.save_pretrained(repo)
    # What Hub repos hold beside the folders: an original single file, other formats, a variant.
    (repo / "flux1-dev.safetensors").write_bytes(b"not read")
    (repo / "vae" / "diffusion_pytorch_model.bin").write_bytes(b"not read")
    shutil.copy(repo / "vae" / "diffusion_pytorch_model.safetensors",
                repo / "vae" / "diffusion_pytorch_model.fp16.safetensors")
    fetched: set[str] = set()
    fake_hub(monkeypatch, repo, fetched)
    pipe, handle = shuttle_diffusers.from_pretrained("owner/repo", revision="v1", device="cpu")
    assert torch.equal(run_flux(pipe), run_flux(ref))
    assert "model_index.json" in fetched and "transformer/config.json" in fetched
    assert "tokenizer/tokenizer.json" in fetched
    assert not {"flux1-dev.safetensors", "vae/diffusion_pytorch_model.bin",
                "vae/diffusion_pytorch_model.fp16.safetensors"} & fetched
    handle.remove()


def test_a_hub_model_fetches_its_config_and_safetensors(tmp_path, monkeypatch, cpu_copy):
    from shuttle.integrations import transformers as shuttle_transformers

    ref = tiny_llama()
    repo = tmp_path / "repo"
    ref.save_pretrained(repo, max_shard_size="20KB")
    (repo / "pytorch_model.bin").write_bytes(b"not read")
    (repo / "original").mkdir()
    (repo / "original" / "consolidated.safetensors").write_bytes(b"not read")
    fetched: set[str] = set()
    fake_hub(monkeypatch, repo, fetched)
    model, handle = shuttle_transformers.from_pretrained("owner/repo", revision="v1",
                                                         device="cpu")
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert fetched == {p.name for p in repo.iterdir() if p.suffix in (".json", ".safetensors")}
    handle.remove()


def test_hub_errors_are_typed(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    from shuttle.integrations import transformers as shuttle_transformers

    def not_found(*args, **kwargs):
        e = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its __init__ wants HTTP
        Exception.__init__(e, "no repo")
        raise e

    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_found)
    with pytest.raises(AdapterFileError, match="neither a local folder nor a Hugging Face"):
        shuttle_transformers.from_pretrained("owner/repo", device="cpu")

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(AdapterFileError, match="cannot be reached.*hf download owner/repo"):
        shuttle_transformers.from_pretrained("owner/repo", device="cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_host_memory_of_a_load_is_the_weights_once(tmp_path):
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from shuttle.integrations import transformers as shuttle_transformers

    config = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048,
                         num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
                         architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        shapes = LlamaForCausalLM(config).state_dict()
    torch.manual_seed(0)
    save_file({k: torch.randn(v.shape) for k, v in shapes.items()},  # ~72 MB
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp_path)
    with host_peak() as peak:
        model, handle = shuttle_transformers.from_pretrained(tmp_path, device="cpu")
    storage = handle.offloaders["model"].storage
    assert storage.weight_bytes >= sum(math.prod(v.shape) * 4 for v in shapes.values())
    assert storage.host_bytes <= 1.01 * storage.weight_bytes
    # The arenas once and a little more (Python objects, headers): no second copy.
    assert peak["bytes"] <= 1.05 * storage.weight_bytes + 8 * 2**20, (peak,
                                                                       storage.weight_bytes)
    handle.remove()
