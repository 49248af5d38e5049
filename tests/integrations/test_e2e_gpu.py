"""End to end on the GPU: mid-size bf16 models offloaded through shuttle give the resident
model's outputs bit for bit.

A FluxPipeline whose transformer has Flux-dev's width (a few blocks) and a Llama with
Llama-3.1-8B's layer width (a few layers), each run plainly on the GPU (the reference) and
under ``offload`` with no budget, with budgets, with adapters merged and dynamic (against the
same adapters merged into, or attached dynamically to, the resident model), after switching
adapters, after ``remove()``; the Llama also in layer mode. ``generate()`` is checked greedy,
sampling and with beam search.

Attention runs on the flash or math kernels of scaled_dot_product_attention: the cuDNN kernel,
which PyTorch prefers on Hopper for many of these shapes, gives different bits from one run to
the next even on the resident model (seen in decode once the KV cache passes a few hundred
tokens), so no bitwise comparison can use it.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import shuttle
from shuttle import StreamConfig
from shuttle.integrations import diffusers as shuttle_diffusers
from shuttle.integrations import transformers as shuttle_transformers
from shuttle.offload import ModelOffloader
from tests.integrations.models import (
    midsize_flux,
    midsize_flux_lora,
    midsize_llama,
    midsize_llama_lora,
    run_midsize_flux,
)

pytestmark = pytest.mark.gpu
pytest.importorskip("diffusers")

GIB = 2**30


@pytest.fixture(scope="module", autouse=True)
def deterministic_attention():
    # Module-scoped so that it is in force before the module's reference fixtures run.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        yield


def nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@contextlib.contextmanager
def adapted(components: dict[str, torch.nn.Module], lora: shuttle.LoRA, mode: str):
    """``lora`` at 0.8 on each resident component it reaches, merged or dynamic, scoped."""
    with contextlib.ExitStack() as stack:
        for module in components.values():
            stack.enter_context(shuttle.apply_lora(module, [(lora, 0.8)], mode=mode))
        yield


# -- a diffusers pipeline ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux():
    """(pipeline on the CPU, adapter, reference pixels: plain, merged, dynamic)."""
    pipe, lora = midsize_flux(), midsize_flux_lora()
    resident = copy.deepcopy(pipe).to("cuda")
    parts = {"transformer": resident.transformer, "text_encoder": resident.text_encoder}
    refs = {"plain": run_midsize_flux(resident)}
    for mode in ("merge", "dynamic"):
        with adapted(parts, lora, mode):
            refs[mode] = run_midsize_flux(resident)
    assert torch.equal(run_midsize_flux(resident), refs["plain"])  # restored, deterministic
    assert not torch.equal(refs["merge"], refs["plain"])
    del resident
    torch.cuda.empty_cache()
    return pipe, lora, refs


@pytest.mark.parametrize("budget", [None, 0.6, 0.8])
def test_flux_pipeline_under_offload_is_the_resident_pipeline(flux, budget):
    original, lora, refs = flux
    pipe = copy.deepcopy(original)
    vram = None if budget is None else int(budget * nbytes(pipe.transformer))
    handle = shuttle_diffusers.offload(pipe, max_host_bytes=16 * GIB, vram_budget=vram,
                                       device="cuda", prefetch=2)
    plans = []  # the denoiser's plan in each of its calls
    hook = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda m, a: plans.append(handle.offloaders["transformer"].plan))
    encoders = {"text_encoder", "text_encoder_2"}
    for i in range(3):  # the first call measures the activations; later ones use them
        assert torch.equal(run_midsize_flux(pipe), refs["plain"])
        # From the second call on, a budget's VAE decode runs over the copies of the next
        # call's encoders (activated ahead: the third call starts on them)
        ahead = {n for n, o in handle.offloaders.items() if o.active} & encoders
        assert ahead == (encoders if i and budget is not None else set()), i
    hook.remove()
    plan = plans[-1]
    if budget is not None:  # weights within the budget less the measured activations
        assert plan.device_bytes + handle.reserves["transformer"] <= vram
        assert any(plan.ring.values())  # something streams
    for mode in ("merge", "dynamic", "merge"):  # switches between modes and back
        assert handle.set_loras([(lora, 0.8)], mode=mode) == {}
        assert torch.equal(run_midsize_flux(pipe), refs[mode]), mode
    handle.set_loras([])
    assert torch.equal(run_midsize_flux(pipe), refs["plain"])
    handle.remove()
    for (name, p), q in zip(pipe.transformer.named_parameters(),
                            original.transformer.parameters(), strict=True):
        assert p.device.type == "cpu" and torch.equal(p, q), name
    pipe.to("cuda")
    assert torch.equal(run_midsize_flux(pipe), refs["plain"])


# -- a transformers causal LM -----------------------------------------------------------------

IDS = torch.arange(3, 3 + 200).remainder(32000).unsqueeze(0) * 7 % 32000
GENERATE = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=50, temperature=0.9),
    "beams": dict(do_sample=False, num_beams=3),
}


def generate(model, kind: str) -> torch.Tensor:
    torch.manual_seed(0)
    with torch.no_grad():
        return model.generate(IDS.cuda(), max_new_tokens=12, pad_token_id=0,
                              **GENERATE[kind])


def greedy_by_hand(model, steps: int = 6) -> torch.Tensor:
    """Prefill, then one token at a time with the KV cache; the logits of every step."""
    with torch.no_grad():
        out = model(IDS.cuda(), use_cache=True)
        logits = [out.logits[:, -1]]
        for _ in range(steps):
            nxt = logits[-1].argmax(-1, keepdim=True)
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1])
        return torch.cat(logits)


@pytest.fixture(scope="module")
def llama():
    """(model on the CPU, adapter, references per mode: generate kinds and by-hand logits)."""
    model, lora = midsize_llama(), midsize_llama_lora()
    resident = copy.deepcopy(model).to("cuda")
    refs = {}
    for mode in ("plain", "merge", "dynamic"):
        with (contextlib.nullcontext() if mode == "plain"
              else adapted({"model": resident}, lora, mode)):
            refs[mode] = {k: generate(resident, k) for k in GENERATE}
            refs[mode]["logits"] = greedy_by_hand(resident)
    assert not torch.equal(refs["merge"]["logits"], refs["plain"]["logits"])
    assert torch.equal(greedy_by_hand(resident), refs["plain"]["logits"])
    del resident
    torch.cuda.empty_cache()
    return model, lora, refs


def check_llama(model, refs: dict) -> None:
    assert torch.equal(greedy_by_hand(model), refs["logits"])
    for kind in GENERATE:
        assert torch.equal(generate(model, kind), refs[kind]), kind


@pytest.mark.parametrize("slots", [None, 2.5, 3.5])
def test_llama_generate_under_offload_is_the_resident_model(llama, slots):
    original, lora, refs = llama
    model = copy.deepcopy(original)
    layer = nbytes(model.model.layers[0])
    rest = nbytes(model) - len(model.model.layers) * layer
    vram = None if slots is None else rest + int(slots * layer)
    handle = shuttle_transformers.offload(model, max_host_bytes=16 * GIB, vram_budget=vram,
                                          device="cuda", prefetch=1)
    assert model.device == torch.device("cuda")
    plans = []  # the model's plan in each call (planned again as activations are measured)
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda m, a: plans.append(handle.offloaders["model"].plan))
    check_llama(model, refs["plain"])
    hook.remove()
    plan = plans[-1]
    # The budget holds the activations too now: at most the resident layers of the weights.
    assert len(plan.resident["model.layers"]) <= {None: 0, 2.5: 0, 3.5: 1}[slots]
    if vram is not None:
        assert plan.device_bytes + handle.reserves["model"] <= vram
    for mode in ("merge", "dynamic"):
        handle.set_loras([(lora, 0.8)], mode=mode)
        check_llama(model, refs[mode])
    handle.set_loras([])
    check_llama(model, refs["plain"])
    handle.remove()
    assert model.device.type == "cpu"
    for p, q in zip(model.parameters(), original.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("keep", [0, 5])
def test_llama_in_layer_mode_is_the_resident_model(llama, keep):
    original, lora, refs = llama
    model = copy.deepcopy(original)
    off = ModelOffloader.from_module(model, layers=True)
    with off.use("cuda", StreamConfig(prefetch=2, resident=keep)):
        assert len(off.plan.layers) == keep
        assert torch.equal(greedy_by_hand(model), refs["plain"]["logits"])
    with off.use("cuda", StreamConfig(prefetch=2, resident=keep), loras=[(lora, 0.8)],
                 mode="merge"):
        assert torch.equal(greedy_by_hand(model), refs["merge"]["logits"])
