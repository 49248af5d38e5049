"""A tiny FluxPipeline offloaded through shuttle, against the same pipeline run plainly.

Copies through the CPU test mode keep every bit, and merged adapters are folded exactly as
``merge_lora`` folds them, so those outputs are compared bit for bit. Dynamic adapters add
``x @ A.T @ B.T`` beside the unchanged weight instead: a different rounding order, compared
within float32 tolerance.
"""

from __future__ import annotations

import copy
import re
import sys

import pytest
import torch

import shuttle
from shuttle.errors import BudgetTooSmallError, MissingDependencyError, ResourceTooLargeError
from shuttle.integrations import diffusers as shuttle_diffusers
from tests.integrations.models import (
    assert_restored,
    flux_lora,
    run_flux,
    snapshot,
    tiny_flux,
)

pytest.importorskip("diffusers")

BLOCKS = ["transformer_blocks", "single_transformer_blocks"]


@pytest.fixture(autouse=True)
def _cpu_copy(cpu_copy):
    """Every test here activates on the CPU through the copy path."""


@pytest.mark.parametrize("vram_budget", [None, 400_000])
def test_outputs_equal_the_plain_pipeline(plain, vram_budget):
    ref, latents, pixels = plain
    pipe = copy.deepcopy(ref)
    handle = shuttle_diffusers.offload(pipe, max_host_bytes=2**22, vram_budget=vram_budget,
                                       device="cpu", prefetch=1)
    off = handle.offloaders
    assert list(off["transformer"].blocks) == BLOCKS
    # With a budget the text encoders may stream too (their plan decides); the VAE moves whole.
    encoders = {"text_encoder": ["encoder.layers"], "text_encoder_2": ["encoder.block"]}
    assert {n: list(o.blocks) for n, o in off.items() if n != "transformer"} == {
        "vae": [], **({n: [] for n in encoders} if vram_budget is None else encoders)}
    assert pipe._execution_device == torch.device("cpu")
    assert torch.equal(run_flux(pipe), latents)
    assert {n for n, o in off.items() if o.active} == {"transformer"}  # stays for the next step
    plan = off["transformer"].plan
    if vram_budget is None:  # every block streams through a ring of prefetch + 1 slots
        assert plan.resident == {b: () for b in BLOCKS} and plan.ring == {b: 2 for b in BLOCKS}
    else:  # the small single blocks fit resident; the double blocks stream through one slot
        assert plan.device_bytes <= vram_budget
        assert plan.resident == {BLOCKS[0]: (), BLOCKS[1]: (0, 1, 2)}
    assert torch.equal(run_flux(pipe, "pt"), pixels)  # through the wrapped vae.decode
    pipe.encode_prompt("a red cat", prompt_2=None, max_sequence_length=16)
    # One component at a time without a budget; the encoders fit beside the VAE in 400 kB.
    assert {n for n, o in off.items() if o.active} == (
        {"text_encoder_2"} if vram_budget is None else {"vae", "text_encoder", "text_encoder_2"})
    handle.remove()


def test_adapters_merge_and_dynamic_match_merge_lora_on_a_copy(plain):
    ref, latents, _ = plain
    lora = flux_lora()
    merged = copy.deepcopy(ref)
    for name in ("transformer", "text_encoder"):
        report = shuttle.merge_lora(getattr(merged, name), [(lora, 0.8)])
        assert len(report.applied) == (3 if name == "transformer" else 1)
    expected = run_flux(merged)
    pipe = copy.deepcopy(ref)
    handle = shuttle_diffusers.offload(pipe, max_host_bytes=2**22, device="cpu", prefetch=1)
    assert handle.set_loras([(lora, 0.8)], mode="merge") == {}
    assert torch.equal(run_flux(pipe), expected)
    assert set(handle.reports) == {"transformer"}  # the last one called is still active
    handle.set_loras([(lora, 0.8)], mode="dynamic")
    torch.testing.assert_close(run_flux(pipe), expected, rtol=1e-4, atol=1e-5)
    assert not torch.equal(expected, latents)  # the adapter does change the output
    handle.set_loras([])
    assert torch.equal(run_flux(pipe), latents)
    handle.remove()


def test_unmatched_adapter_keys_are_reported():
    pipe = tiny_flux()
    handle = shuttle_diffusers.offload(pipe, max_host_bytes=2**22, device="cpu")
    lora = shuttle.load_lora({"transformer.nowhere.lora_A.weight": torch.ones(2, 4),
                              "transformer.nowhere.lora_B.weight": torch.ones(4, 2)})
    assert list(handle.set_loras([(lora, 1.0)])) == ["transformer.nowhere"]
    assert list(handle.unmatched) == ["transformer.nowhere"]
    handle.remove()


def test_remove_restores_the_pipeline(plain):
    ref, latents, _ = plain
    pipe = copy.deepcopy(ref)
    before = {n: snapshot(m) for n, m in pipe.components.items()
              if isinstance(m, torch.nn.Module)}
    handle = shuttle_diffusers.offload(pipe, max_host_bytes=2**22, device="cpu")
    handle.set_loras([(flux_lora(), 0.5)], mode="dynamic")
    run_flux(pipe, "pt")
    handle.remove()
    for name, snap in before.items():
        assert_restored(getattr(pipe, name), snap)
    assert torch.equal(run_flux(pipe), latents)
    shuttle_diffusers.offload(pipe, max_host_bytes=2**22, device="cpu").remove()  # again


def test_budgets_too_small_raise_and_change_nothing(plain):
    ref, latents, _ = plain
    pipe = copy.deepcopy(ref)
    before = {n: snapshot(m) for n, m in pipe.components.items()
              if isinstance(m, torch.nn.Module)}
    with pytest.raises(ResourceTooLargeError):
        shuttle_diffusers.offload(pipe, max_host_bytes=100_000, device="cpu")
    with pytest.raises(BudgetTooSmallError):
        shuttle_diffusers.offload(pipe, max_host_bytes=2**22, vram_budget=1000, device="cpu")
    for name, snap in before.items():
        assert_restored(getattr(pipe, name), snap)
    assert torch.equal(run_flux(pipe), latents)


def test_each_refusal_names_a_floor_the_next_budget_can_take(plain):
    # A user finds the smallest budget that runs by following the floors the refusals name
    # (a module moved whole, block lists, measured activations: each says "at least N bytes").
    ref, latents, _ = plain
    vram, named = 1, []
    for _ in range(8):
        pipe = copy.deepcopy(ref)
        try:
            handle = shuttle_diffusers.offload(pipe, max_host_bytes=2**22, vram_budget=vram,
                                               device="cpu")
            got = run_flux(pipe)
        except BudgetTooSmallError as e:
            floor = re.search(r"at least (\d+) bytes", str(e))
            assert floor is not None and int(floor.group(1)) > vram, str(e)
            vram = int(floor.group(1))
            named.append(vram)
            continue
        handle.remove()
        break
    else:
        pytest.fail(f"no budget ran after the floors {named}")
    assert named and torch.equal(got, latents)


def test_a_missing_diffusers_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # makes `import diffusers` fail
    with pytest.raises(MissingDependencyError, match="pip install diffusers"):
        shuttle_diffusers.offload(object(), max_host_bytes=1)


def test_the_plan_is_chosen_at_offload_and_once_more_when_measured(plain, monkeypatch):
    # The handle plans each component at offload time (its first call's plan: ring only) and
    # once more after its first call measured its activations; later calls that measure
    # nothing new never plan again (accelerate's device map, computed once).
    from shuttle.offload import ModelOffloader

    ref, latents, _ = plain
    calls = []
    plan_for = ModelOffloader.plan_for
    monkeypatch.setattr(ModelOffloader, "plan_for", lambda self, stream: (
        stream is None or stream.vram_budget == 400_000) and calls.append(stream)
        or plan_for(self, stream))  # not the plans of modules activated ahead, in less room
    pipe = copy.deepcopy(ref)
    handle = shuttle_diffusers.offload(pipe, max_host_bytes=2**22, vram_budget=400_000,
                                       device="cpu", prefetch=1)
    planned = {n: o for n, o in handle.offloaders.items()}
    assert len(calls) == len(planned)
    assert torch.equal(run_flux(pipe), latents)
    streamed = [n for n, o in planned.items() if o.blocks]  # the VAE (not called) moves whole
    assert len(streamed) == 3 and len(calls) == len(planned) + len(streamed)
    assert torch.equal(run_flux(pipe), latents)
    assert len(calls) == len(planned) + len(streamed)
    assert planned["transformer"].plan.device_bytes <= 400_000
    handle.remove()
