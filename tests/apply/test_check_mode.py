"""One ``check_mode`` for every entry point that takes an adapter ``mode=``: a mode none of
``merge``/``dynamic``/``auto`` raises ``InvalidOptionError`` naming the entry point and the
valid modes, before anything changes."""

from __future__ import annotations

import pytest
import torch

import shuttle
from shuttle.apply.plan import MODES, check_mode
from shuttle.errors import InvalidOptionError
from tests import lowrank_state


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8))


def _lora() -> shuttle.LoRA:
    return shuttle.load_lora(lowrank_state({"0": (8, 8)}, rank=2))


def _apply_lora(mode):
    model = _net()
    with shuttle.apply_lora(model, [(_lora(), 1.0)], mode=mode):
        pass


def _offloader_use(mode):
    off = shuttle.ModelOffloader.from_module(_net())
    with off.use("cpu", loras=[(_lora(), 1.0)], mode=mode):
        pass


def _cache_use(mode):
    cache = shuttle.ModelCache(max_bytes=2**20)
    with cache.use(shuttle.ModelSpec("net", _net), device="cpu",
                   loras=[(shuttle.LoRASpec("s", _lora()), 1.0)], mode=mode):
        pass


def _set_loras(mode):
    pytest.importorskip("transformers")
    from shuttle.integrations import transformers as shuttle_transformers
    from tests.integrations.models import llama_lora, tiny_llama

    handle = shuttle_transformers.offload(tiny_llama(), max_host_bytes=2**20, device="cpu")
    try:
        handle.set_loras([(llama_lora(), 1.0)], mode=mode)
    finally:
        handle.remove()


ENTRY_POINTS = {"apply_lora": _apply_lora, "ModelOffloader.activate": _offloader_use,
                "ModelCache.use": _cache_use, "OffloadHandle.set_loras": _set_loras}


@pytest.mark.parametrize("mode", ["sideways", "Merge", None, 1])
@pytest.mark.parametrize("where", ENTRY_POINTS)
def test_a_bad_mode_raises_naming_the_valid_ones(cpu_copy, where, mode):
    with pytest.raises(InvalidOptionError) as e:
        ENTRY_POINTS[where](mode)
    msg = str(e.value)
    assert msg.startswith(f"{where}: mode={mode!r}:"), msg
    assert all(f"'{m}'" in msg for m in MODES), msg


@pytest.mark.parametrize("where", ENTRY_POINTS)
def test_every_valid_mode_passes(cpu_copy, where):
    for mode in MODES:
        ENTRY_POINTS[where](mode)


def test_check_mode_lists_every_mode():
    for mode in MODES:
        check_mode(mode, "x")
    with pytest.raises(InvalidOptionError, match=r"^f: mode=\['merge'\]: expected 'merge'"):
        check_mode(["merge"], "f")
