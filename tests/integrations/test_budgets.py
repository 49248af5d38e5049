"""byte_budgets: budgets in bytes, their spellings, and ``"auto"``: what the machine has free
as the call starts (the device's free memory and the host's available memory, each less a
reserve), the probes replaced by fakes."""

from __future__ import annotations

import pytest
import torch

from shuttle.errors import CacheError, HostMemoryError, OffloadError
from shuttle.integrations import budgets
from shuttle.integrations.budgets import VRAM_RESERVE, byte_budgets
from shuttle.offload.host_memory import HOST_RESERVE

GIB = 2**30
CUDA = torch.device("cuda")


@pytest.fixture
def free_vram(monkeypatch):
    """Set what ``torch.cuda.mem_get_info`` reports free (of 80 GiB)."""
    seen = []

    def fake(device):
        seen.append(device)
        return free[0], 80 * GIB
    free = [0]
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake)

    def set_free(n: int) -> list:
        free[0] = n
        return seen
    return set_free


def test_numbers_and_spellings_pass_through():
    assert byte_budgets(6 * GIB, "16GiB") == (6 * GIB, 16 * GIB)
    assert byte_budgets(None, None) == (None, None)
    assert byte_budgets("6e9", 1.5e9) == (6 * 10**9, 15 * 10**8)


@pytest.mark.parametrize(("free", "budget"), [
    (8 * GIB, 8 * GIB - 8 * GIB // 10),  # a tenth of what is free stays free
    (GIB, GIB - VRAM_RESERVE),           # at least VRAM_RESERVE does
])
@pytest.mark.parametrize("spelling", ["auto", "AUTO", " Auto "])
def test_auto_vram_is_the_devices_free_memory_less_a_reserve(free_vram, free, budget,
                                                             spelling):
    seen = free_vram(free)
    assert byte_budgets(spelling, None, CUDA) == (budget, None)
    assert seen == [CUDA]


def test_auto_vram_with_nothing_past_the_reserve_free_is_refused(free_vram):
    free_vram(VRAM_RESERVE)
    with pytest.raises(OffloadError, match="0.5 GiB is free on cuda.*nvidia-smi"):
        byte_budgets("auto", None, CUDA)


@pytest.mark.parametrize("device", [torch.device("cpu"), None])
def test_auto_vram_without_a_cuda_device_is_refused(free_vram, device):
    seen = free_vram(8 * GIB)
    with pytest.raises(OffloadError, match="not one; give vram_budget in bytes"):
        byte_budgets("auto", None, device)
    assert not seen


def test_auto_host_is_the_memory_available_less_the_reserve(monkeypatch):
    monkeypatch.setattr(budgets, "available_host_bytes", lambda: HOST_RESERVE + 5 * GIB)
    assert byte_budgets(None, "auto") == (None, 5 * GIB)


@pytest.mark.parametrize("available", [None, HOST_RESERVE])
def test_auto_host_with_nothing_to_give_is_refused(monkeypatch, available):
    monkeypatch.setattr(budgets, "available_host_bytes", lambda: available)
    with pytest.raises(HostMemoryError, match="number of bytes"):
        byte_budgets(None, "auto")


@pytest.mark.parametrize(("vram", "host", "error"), [
    ("autom", None, OffloadError), (None, "auto-ish", CacheError), (-1, None, OffloadError)])
def test_other_words_are_refused(vram, host, error):
    with pytest.raises(error):
        byte_budgets(vram, host, CUDA)


def test_from_pretrained_refuses_auto_vram_on_the_cpu_before_the_files_are_looked_at(tmp_path):
    transformers = pytest.importorskip("shuttle.integrations.transformers")
    with pytest.raises(OffloadError, match="vram_budget='auto'"):
        transformers.from_pretrained(tmp_path / "nowhere", device="cpu", vram_budget="auto")
