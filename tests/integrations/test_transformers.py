"""A tiny Llama offloaded through shuttle against the same model run plainly.

CPU test-mode copies keep every bit and merged adapters fold as ``merge_lora`` does, so logits
and greedy tokens are compared exactly; dynamic adapters round differently (the residual is
added beside the weight), so within float32 tolerance.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

import shuttle
from shuttle.errors import MissingDependencyError, OffloadError, ResourceTooLargeError
from shuttle.integrations import transformers as shuttle_transformers
from tests.integrations.models import assert_restored, llama_lora, snapshot, tiny_llama

pytest.importorskip("transformers")

IDS = torch.tensor([[3, 14, 15, 9, 26]])


@pytest.fixture(autouse=True)
def _cpu_copy(cpu_copy):
    """Every test here activates on the CPU through the copy path."""


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def generate(model) -> torch.Tensor:
    return model.generate(IDS, max_new_tokens=6, do_sample=False)


@pytest.mark.parametrize("vram_budget", [None, 130_000])
def test_logits_and_generate_equal_the_plain_model(vram_budget):
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    handle = shuttle_transformers.offload(model, max_host_bytes=2**20, vram_budget=vram_budget,
                                          device="cpu", prefetch=1)
    assert torch.equal(logits(model), logits(ref))
    assert torch.equal(generate(model), generate(ref))
    off = handle.offloaders["model"]
    assert list(off.blocks) == ["model.layers"]
    # 130 kB holds the non-layer weights and all three layers: nothing streams then.
    assert off.plan.resident["model.layers"] == (() if vram_budget is None else (0, 1, 2))
    assert vram_budget is None or off.plan.device_bytes <= vram_budget
    handle.remove()


def test_adapters_merge_and_dynamic_match_merge_lora_on_a_copy():
    ref, lora = tiny_llama(), llama_lora()
    merged = copy.deepcopy(ref)
    assert len(shuttle.merge_lora(merged, [(lora, 0.7)]).applied) == 3
    model = copy.deepcopy(ref)
    handle = shuttle_transformers.offload(model, max_host_bytes=2**20, device="cpu", prefetch=1)
    handle.set_loras([(lora, 0.7)], mode="merge")
    assert torch.equal(logits(model), logits(merged))
    assert torch.equal(generate(model), generate(merged))
    assert len(handle.reports["model"].applied) == 3
    handle.set_loras([(lora, 0.7)], mode="dynamic")
    torch.testing.assert_close(logits(model), logits(merged), rtol=1e-4, atol=1e-5)
    handle.set_loras([])
    assert torch.equal(logits(model), logits(ref))
    handle.remove()


@pytest.mark.parametrize("device", [
    pytest.param(d, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))
    for d in ("cuda", "cuda:0")] + ["cpu"])
def test_the_model_reports_its_compute_device_not_its_host_memory(device):
    # generate() puts its inputs and the tensors it makes on model.device. On a CPU machine
    # compute and host devices coincide, so the report is checked without a forward: the
    # parameters stay in host memory (cpu) and model.device must still say `device`.
    model = tiny_llama()
    cls = type(model)
    handle = shuttle_transformers.offload(model, max_host_bytes=2**20, device=device)
    assert model.device == torch.device(device)
    assert next(model.parameters()).device.type == "cpu"
    assert isinstance(model, cls) and type(model).__name__ == cls.__name__
    handle.remove()
    assert type(model) is cls and model.device.type == "cpu"


def test_remove_restores_the_model():
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    before = snapshot(model)
    handle = shuttle_transformers.offload(model, max_host_bytes=2**20, device="cpu")
    handle.set_loras([(llama_lora(), 1.0)], mode="dynamic")
    generate(model)
    with pytest.raises(OffloadError, match="offloaded already"):
        shuttle_transformers.offload(model, max_host_bytes=2**20, device="cpu")
    handle.remove()
    handle.remove()  # a second remove does nothing
    assert type(model) is type(ref)
    assert_restored(model, before)
    assert torch.equal(generate(model), generate(ref))


def test_a_host_budget_too_small_raises_and_changes_nothing():
    model = tiny_llama()
    before = snapshot(model)
    with pytest.raises(ResourceTooLargeError):
        shuttle_transformers.offload(model, max_host_bytes=10_000, device="cpu")
    assert_restored(model, before)


def test_a_missing_transformers_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(MissingDependencyError, match="pip install transformers"):
        shuttle_transformers.offload(object(), max_host_bytes=1)


def test_compressed_weights_give_the_same_logits_and_tokens(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from shuttle.kernels import exponent_decode

    monkeypatch.setattr(exponent_decode, "interpreting", lambda: False)  # CPU: the reference
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    ref = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model = copy.deepcopy(ref)
    before = snapshot(model)
    handle = shuttle_transformers.offload(model, max_host_bytes=2**24, device="cpu",
                                          prefetch=1, compress="lossless")
    off = handle.offloaders["model"]
    assert all(u.code is not None for u in off.storage.groups["model.layers"])
    assert torch.equal(logits(model), logits(ref))
    assert torch.equal(generate(model), generate(ref))
    handle.remove()
    assert_restored(model, before)  # given back decoded, bit for bit
