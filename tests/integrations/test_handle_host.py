"""The handle's host ceiling: modules captured from their files share one budget, disk included."""

from __future__ import annotations

import copy

import pytest
import torch

import shuttle
from shuttle.cache import ModelCache
from shuttle.errors import BudgetTooSmallError
from shuttle.formats.safetensors_file import SafetensorsFile
from shuttle.integrations.budgets import read_order
from shuttle.integrations.handle import OffloadHandle
from tests.offload.models import TinyDiT


@pytest.fixture(autouse=True)
def _cpu_copy(cpu_copy):
    """Activations copy through slots and hooks, as on CUDA."""


def files(tmp_path):
    """Two modules saved to files: a transformer with block lists and an encoder moved whole."""
    from safetensors.torch import save_model

    torch.manual_seed(0)
    refs = {"transformer": TinyDiT(), "text_encoder": TinyDiT(n_blocks=2, n_single=1)}
    out = {}
    for name, ref in refs.items():
        save_model(ref, str(tmp_path / f"{name}.safetensors"))
        out[name] = SafetensorsFile(tmp_path / f"{name}.safetensors")
    return refs, out


def handle(refs, opened, budget, vram_budget=None, blocks=None, hot=()):
    with torch.device("meta"):
        modules = {"transformer": TinyDiT(), "text_encoder": TinyDiT(n_blocks=2, n_single=1)}
    cache = ModelCache(budget)
    h = OffloadHandle(modules, blocks or {"transformer": ["blocks", "single"]}, cache=cache,
                      device="cpu", prefetch=1, vram_budget=vram_budget, hot=hot,
                      sources={n: {k: f.tensor_ref(k) for k in f} for n, f in opened.items()})
    return h, modules, cache


def run(refs, modules, x):
    with torch.no_grad():
        for name in ("text_encoder", "transformer"):
            assert torch.equal(modules[name](x), refs[name](x)), name


def weights(module):
    return sum(t.nbytes for t in {id(t): t for t in [*module.parameters(),
                                                     *module.buffers()]}.values())


@pytest.mark.parametrize("vram_budget", [None, 200_000])
def test_modules_beyond_the_budget_stream_from_their_files(tmp_path, monkeypatch, vram_budget):
    # Staging buffers of one page: a module moved whole can stay on disk too (read in chunks).
    monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", 4096)
    monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", 4096)
    refs, opened = files(tmp_path)
    total = sum(weights(m) for m in refs.values())
    budget = total // 2
    h, modules, cache = handle(refs, opened, budget, vram_budget)
    stores = {n: off.storage for n, off in h.offloaders.items()}
    assert all(s.max_host_bytes is not None for s in stores.values())
    # The streamed transformer gets what is left after every floor before the encoder does.
    floors = {n: c.host_floor for n, c in h._components.items()}
    assert stores["text_encoder"].max_host_bytes == floors["text_encoder"]
    assert stores["transformer"].max_host_bytes > floors["transformer"]
    x = torch.randint(0, 64, (2, 9))
    for _ in range(2):
        run(refs, modules, x)
        assert sum(s.host_bytes for s in stores.values()) <= budget
        assert cache.used_bytes <= budget
    assert all(s.reader.bytes_read > 0 for s in stores.values())
    h.remove()
    assert len(cache) == 0


def test_read_order_puts_hot_modules_then_streamed_ones_first():
    blocks = {"text_encoder_2": ["encoder.block"], "transformer": ["blocks"]}
    names = ["text_encoder", "text_encoder_2", "transformer", "vae"]
    assert read_order(names, blocks) == ["text_encoder_2", "transformer", "text_encoder", "vae"]
    assert read_order(names, blocks, hot=["transformer"]) == [
        "transformer", "text_encoder_2", "text_encoder", "vae"]


def test_the_hot_module_gets_host_memory_before_an_encoder_that_streams_too(tmp_path):
    # Both stream (as a pipeline's text encoder does under a VRAM budget) and the encoder comes
    # first in the pipeline's order; the denoiser, read at every step, still gets the room
    # (a budget where what is left after the floors makes neither whole).
    refs, opened = files(tmp_path)
    budget = sum(weights(m) for m in refs.values()) * 2 // 5
    both = {"transformer": ["blocks", "single"], "text_encoder": ["blocks"]}
    for hot, fed, starved in [(("transformer",), "transformer", "text_encoder"),
                              (("text_encoder",), "text_encoder", "transformer")]:
        h, modules, cache = handle(refs, opened, budget, blocks=both, hot=hot)
        c = h._components
        assert c[starved].share == c[starved].host_floor
        assert c[fed].share > c[fed].host_floor
        run(refs, modules, torch.randint(0, 64, (2, 9)))
        h.remove()


def test_modules_that_fit_are_kept_whole_in_host_memory(tmp_path):
    refs, opened = files(tmp_path)
    h, modules, cache = handle(refs, opened, 10**9)
    assert all(off.storage.max_host_bytes is None and off.storage.reader is None
               for off in h.offloaders.values())
    run(refs, modules, torch.randint(0, 64, (2, 9)))


def test_a_budget_below_the_floors_raises_and_changes_nothing(tmp_path):
    refs, opened = files(tmp_path)
    with pytest.raises(BudgetTooSmallError, match="give at least"):
        handle(refs, opened, 20_000)
    # nothing captured: the cache is empty (the modules were built inside handle())
    cache = ModelCache(20_000)
    with torch.device("meta"):
        modules = {"transformer": TinyDiT(), "text_encoder": TinyDiT(n_blocks=2, n_single=1)}
    with pytest.raises(BudgetTooSmallError):
        OffloadHandle(modules, {"transformer": ["blocks"]}, cache=cache, device="cpu",
                      sources={n: {k: f.tensor_ref(k) for k in f} for n, f in opened.items()})
    assert len(cache) == 0 and all(p.is_meta for m in modules.values()
                                   for p in m.parameters())


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_adapters_get_room_from_the_shares(tmp_path, mode):
    refs, opened = files(tmp_path)
    budget = sum(weights(m) for m in refs.values()) * 2 // 3
    h, modules, cache = handle(refs, opened, budget)
    x = torch.randint(0, 64, (2, 9))
    run(refs, modules, x)
    g = torch.Generator().manual_seed(1)
    diffs = {"blocks.1.up.diff": torch.randn(128, 32, generator=g) * 0.01,
             "norm.diff": torch.randn(32, generator=g) * 0.1}
    lora = shuttle.load_lora({f"transformer.{k}": v for k, v in diffs.items()})
    assert lora.nbytes > cache.available_bytes  # room must be made
    shares = {n: c.share for n, c in h._components.items()}
    assert h.set_loras([(lora, 1.0)], mode=mode) == {}
    # Room is made at once: the adapter is loaded before the next activation settles.
    assert sum(off.storage.host_bytes for off in h.offloaders.values()) + lora.nbytes <= budget
    merged = copy.deepcopy(refs["transformer"])
    shuttle.merge_lora(merged, [(shuttle.load_lora(diffs), 1.0)])
    with torch.no_grad():
        got = modules["transformer"](x)
        if mode == "merge":
            assert torch.equal(got, merged(x))
        else:
            torch.testing.assert_close(got, merged(x), rtol=1e-5, atol=1e-5)
    assert cache.used_bytes <= budget
    assert sum(c.share for c in h._components.values()) < sum(shares.values())
    assert sum(off.storage.host_bytes for off in h.offloaders.values()) + lora.nbytes <= budget


def test_adapters_take_room_from_the_least_often_read_module_first(tmp_path):
    # Both stream and both hold more than their floors; the denoiser (hot) keeps its share.
    refs, opened = files(tmp_path)
    budget = sum(weights(m) for m in refs.values()) * 9 // 10
    both = {"transformer": ["blocks", "single"], "text_encoder": ["blocks"]}
    h, modules, cache = handle(refs, opened, budget, blocks=both, hot=("transformer",))
    c = h._components
    before = {n: c[n].share for n in c}
    assert all(before[n] > c[n].host_floor for n in c)
    g = torch.Generator().manual_seed(1)
    lora = shuttle.load_lora({"transformer.blocks.1.up.diff":
                              torch.randn(128, 32, generator=g) * 0.01})
    room = before["text_encoder"] - c["text_encoder"].host_floor
    assert cache.available_bytes < lora.nbytes < room
    assert h.set_loras([(lora, 1.0)]) == {}
    assert c["transformer"].share == before["transformer"]
    assert c["text_encoder"].share < before["text_encoder"]
    merged = copy.deepcopy(refs["transformer"])
    shuttle.merge_lora(merged, [(lora, 1.0)])
    x = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(modules["transformer"](x), merged(x))
        assert torch.equal(modules["text_encoder"](x), refs["text_encoder"](x))
    h.remove()
