from __future__ import annotations

import gc

import pytest
import torch

from shuttle.errors import BlockLayoutError, HostBackingError
from shuttle.offload import HostStorage, Layout, ModelOffloader, StreamConfig
from tests.offload.models import Block, TinyDiT


def snapshot(model):
    return {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict(keep_vars=True).items()}


def assert_unchanged(model, before):
    after = model.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    for k, (ptr, value) in before.items():
        assert after[k].data_ptr() == ptr, k
        assert torch.equal(after[k], value), k


def groups(model):
    return {"blocks": list(model.blocks), "single": list(model.single)}


def inside(t: torch.Tensor, flat: torch.Tensor) -> bool:
    return flat.data_ptr() <= t.data_ptr() < flat.data_ptr() + flat.numel()


def test_layout_aligns_and_round_trips():
    specs = [(torch.float32, torch.Size([3])), (torch.bfloat16, torch.Size([2, 5])),
             (torch.int64, torch.Size([])), (torch.float32, torch.Size([0, 4]))]
    layout = Layout.of(specs)
    assert all(o % 16 == 0 for o in layout.offsets)
    assert layout.weight_bytes == 12 + 20 + 8
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(flat)
    assert [(v.dtype, v.shape) for v in views] == specs
    views[1].fill_(1.5)
    assert torch.equal(layout.views(flat)[1], torch.full((2, 5), 1.5, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pinned_capture_copies_once_into_arenas(dtype):
    model = TinyDiT(dtype=dtype)
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    values = {k: v.clone() for k, v in model.state_dict().items()}
    storage = HostStorage(model, groups(model), "pinned")
    # Page-locked where CUDA is present; without it plain memory, reported honestly.
    assert storage.pinned is torch.cuda.is_available()
    unique = {id(p): p for p in params.values()}
    weights = sum(p.nbytes for p in unique.values()) + sum(b.nbytes for b in model.buffers())
    assert storage.weight_bytes == weights
    # Pinned arenas are whole pages (no registered page shared with other memory): at most one
    # page of slack per unit (the blocks and the rest).
    slack = 4096 * (len(model.blocks) + 1) if storage.pinned else 0
    assert storage.host_bytes <= 1.02 * weights + slack
    # identity kept, values kept, every tensor a view of its unit's arena
    for n, p in model.named_parameters(remove_duplicate=False):
        assert p is params[n]
    for k, v in model.state_dict().items():
        assert torch.equal(v, values[k]), k
    for i, block in enumerate(model.blocks):
        arena = storage.groups["blocks"][i].arena
        assert all(inside(t, arena) for t in [*block.parameters(), *block.buffers()])
    assert inside(model.embed.weight, storage.rest.arena)


def test_tied_weights_are_one_host_copy():
    model = TinyDiT()
    storage = HostStorage(model, groups(model))
    assert model.head.weight is model.embed.weight
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    untied = TinyDiT(tie=False)
    assert HostStorage(untied, groups(untied)).weight_bytes == (
        storage.weight_bytes + model.embed.weight.nbytes)


def test_buffers_are_captured():
    model = TinyDiT()
    scale = model.blocks[2].scale.clone()
    storage = HostStorage(model, groups(model))
    assert torch.equal(model.blocks[2].scale, scale)
    assert inside(model.blocks[2].scale, storage.groups["blocks"][2].arena)


def test_adopt_is_zero_copy():
    model = TinyDiT()
    before = snapshot(model)
    storage = HostStorage(model, groups(model), "adopt")
    assert storage.host_bytes == 0
    assert_unchanged(model, before)


def test_adopt_shares_storage_with_the_models_tensors(cpu_copy):
    """host="adopt" keeps the model's own CPU tensors: every host tensor of every unit is the
    memory the model's parameter or buffer already had, before and after an activation."""
    model = TinyDiT()
    ptrs = {k: v.data_ptr() for k, v in model.state_dict(keep_vars=True).items()}
    off = ModelOffloader.from_module(model, blocks=["blocks", "single"], host="adopt")
    assert off.storage.host_bytes == 0
    for unit in off.storage.units:
        for b in unit.bindings:
            table = b.module._parameters if b.is_param else b.module._buffers
            assert unit.host_views[b.entry].data_ptr() == table[b.name].data_ptr(), (
                f"{b.name} of unit {unit.name or '(rest)'} was copied, not adopted")
    with off.use("cpu", StreamConfig(prefetch=1)), torch.no_grad():
        off.model(torch.randint(0, 64, (2, 5)))  # tensors bound to device slots meanwhile
    assert {k: v.data_ptr() for k, v in model.state_dict(keep_vars=True).items()} == ptrs


@pytest.mark.parametrize("host", ["pinned", "adopt"])
def test_meta_tensors_raise_before_any_change(host):
    model = TinyDiT()
    model.single[1].up = torch.nn.Linear(32, 64, device="meta")
    before = {k: v.data_ptr() for k, v in model.state_dict().items() if not v.is_meta}
    with pytest.raises(HostBackingError, match="single.1.up.weight.*meta"):
        HostStorage(model, groups(model), host)
    assert {k: v.data_ptr() for k, v in model.state_dict().items() if not v.is_meta} == before


def test_tie_across_units_raises_before_any_change():
    model = TinyDiT()
    model.blocks[0].attn.weight = model.blocks[1].attn.weight
    before = snapshot(model)
    with pytest.raises(BlockLayoutError, match="shared between two offload units"):
        HostStorage(model, groups(model))
    assert_unchanged(model, before)


def test_blocks_that_differ_share_a_group_each_with_its_own_layout():
    model = TinyDiT()
    model.blocks[0].register_buffer("bias", torch.rand(3, 4))  # like T5's first block
    values = {k: v.clone() for k, v in model.state_dict().items()}
    storage = HostStorage(model, {"mixed": [*model.blocks, *model.single]})
    units = storage.groups["mixed"]
    assert [u.name for u in units] == [f"mixed.{i}" for i in range(8)]
    assert units[0].layout != units[1].layout == units[4].layout != units[5].layout
    assert units[0].layout.nbytes > units[1].layout.nbytes > units[5].layout.nbytes
    assert all(torch.equal(v, values[k]) for k, v in model.state_dict().items())
    assert inside(model.blocks[0].bias, units[0].arena)


class FakeCudart:
    def __init__(self):
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - CUDA's name
        assert ptr % 4096 == 0 and size % 4096 == 0
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_pinned_bytes_are_exact_registrations(monkeypatch):
    # The CUDA path without CUDA: registration is mocked, the accounting is real.
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256),
                                torch.nn.ModuleList(Block(256, 1024) for _ in range(3)))
    storage = HostStorage(model, {"1": list(model[1])}, "pinned")
    assert storage.pinned and storage.pinned_bytes == storage.host_bytes
    assert len(fake.registered) == 4  # one arena per block plus the rest: no per-tensor pins
    assert storage.host_bytes <= 1.02 * storage.weight_bytes
    ptrs = set(fake.registered)
    del storage
    gc.collect()
    assert set(fake.unregistered) == ptrs


@pytest.mark.parametrize("nbytes", [5000, 3 * 2**20 + 5])
def test_arenas_to_pin_are_whole_aligned_pages(nbytes):
    """Arenas that will be registered cover whole pages from a page boundary (large ones are
    huge-page maps, aligned to 2 MiB); arenas that will not are exactly the bytes asked for."""
    import mmap

    from shuttle.offload.arena import new_arena as _arena

    pages = _arena(nbytes, pin=True)
    assert pages.numel() == -(-nbytes // 4096) * 4096 and pages.data_ptr() % 4096 == 0
    if nbytes >= 2**21 and hasattr(mmap, "MADV_HUGEPAGE"):
        assert pages.data_ptr() % 2**21 == 0
    pages.fill_(7)  # writable, all of it
    assert int(pages[-1]) == 7
    assert _arena(nbytes, pin=False).numel() == nbytes


def _saved(model, tmp_path):
    """``model`` saved as safetensors (tied tensors once), opened by its header."""
    from safetensors.torch import save_model

    from shuttle.formats.safetensors_file import SafetensorsFile

    save_model(model, str(tmp_path / "model.safetensors"))
    return SafetensorsFile(tmp_path / "model.safetensors")


@pytest.mark.parametrize("host", ["pinned", "adopt"])
@pytest.mark.parametrize("stream", [None, StreamConfig(prefetch=1, resident=1)])
def test_a_meta_model_is_filled_straight_from_its_file(cpu_copy, tmp_path, host, stream):
    ref = TinyDiT()
    file = _saved(ref, tmp_path)
    assert "embed.weight" not in file or "head.weight" not in file  # tied: once
    with torch.device("meta"):
        model = TinyDiT()
    off = ModelOffloader.from_module(model, blocks=["blocks", "single"], host=host,
                                     sources={k: file.tensor_ref(k) for k in file})
    assert model.head.weight is model.embed.weight
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert off.storage.weight_bytes == sum(
        t.nbytes for t in {id(t): t for t in [*ref.parameters(), *ref.buffers()]}.values())
    x = torch.randint(0, 64, (2, 9))
    with torch.no_grad(), off.use("cpu", stream) as m:
        assert torch.equal(m(x), ref(x))


def test_a_meta_tensor_without_a_file_or_with_another_dtype_is_refused(tmp_path):
    file = _saved(TinyDiT(), tmp_path)
    sources = {k: file.tensor_ref(k) for k in file}
    with torch.device("meta"):
        model = TinyDiT()
    missing = {k: v for k, v in sources.items() if k != "blocks.1.up.weight"}
    with pytest.raises(HostBackingError, match=r"blocks\.1\.up\.weight is on the meta device"):
        HostStorage(model, groups(model), sources=missing)
    with torch.device("meta"):
        model = TinyDiT()
    model.norm.weight.data = torch.empty(32, dtype=torch.float8_e4m3fn, device="meta")
    with pytest.raises(HostBackingError, match="norm.weight.*build the model with the checkp"):
        HostStorage(model, groups(model), sources=sources)  # float8 needs scales: no cast
    with torch.device("meta"):
        model = TinyDiT()
    model.blocks[0].up.weight.data = torch.empty(2, 32, device="meta")
    with pytest.raises(HostBackingError, match=r"blocks\.0\.up\.weight.*\(128, 32\)"):
        HostStorage(model, groups(model), sources=sources)


@pytest.mark.parametrize("host", ["pinned", "adopt"])
def test_a_file_of_another_floating_dtype_is_converted_while_read(cpu_copy, tmp_path, host,
                                                                    monkeypatch):
    import shuttle.formats.safetensors_file as sf

    ref = TinyDiT()
    file = _saved(ref, tmp_path)  # float32
    monkeypatch.setattr(sf, "_CONVERT_PIECE", 300)  # several pieces per tensor
    reads = []
    monkeypatch.setattr(sf.SafetensorsFile, "read_rows", _recorded(sf.SafetensorsFile.read_rows,
                                                                   reads))
    with torch.device("meta"):
        model = TinyDiT(dtype=torch.bfloat16)
    off = ModelOffloader.from_module(model, blocks=["blocks", "single"], host=host,
                                     sources={k: file.tensor_ref(k) for k in file})
    expected = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
    assert {k: v.dtype for k, v in model.state_dict().items()} == {
        k: torch.bfloat16 for k in expected}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    # embed.weight is 64 x 32 float32 (8 KiB): read 2 rows (256 B) at a time, never whole
    embed = [(a, b) for key, a, b in reads if key == "embed.weight"]
    assert embed == [(i, i + 2) for i in range(0, 64, 2)]
    x = torch.randint(0, 64, (2, 9))
    half = TinyDiT(dtype=torch.bfloat16)
    half.load_state_dict(ref.state_dict())
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=1)) as m:
        assert torch.equal(m(x), half(x))


def _recorded(read_rows, calls):
    def wrapper(self, key, start, stop, out=None):
        calls.append((key, start, stop))
        return read_rows(self, key, start, stop, out)
    return wrapper


def test_capture_fills_a_bounded_window_of_units_ahead_of_the_one_it_binds(monkeypatch):
    """While one unit is slow to fill (a module moved whole: gigabytes), the workers must not
    fill every later arena: each unit's pageable originals are freed only when it is bound, in
    order, so arenas filled ahead hold the model twice. At most the window of units is filled
    and not yet bound."""
    import threading
    import time

    from shuttle.offload import host_storage

    model = TinyDiT(n_blocks=12)
    real_fill, real_keep = HostStorage._fill, HostStorage._keep
    lock, state = threading.Lock(), {"filled": 0, "kept": 0, "ahead": 0}

    def fill(self, s, pin, planned=None):
        if s.name == "":  # the rest (the first unit) fills slowly: the others could run ahead
            time.sleep(0.3)
        got = real_fill(self, s, pin, planned)
        with lock:
            state["filled"] += 1
            state["ahead"] = max(state["ahead"], state["filled"] - state["kept"])
        return got

    def keep(self, unit, *got):
        with lock:
            state["kept"] += 1
        real_keep(self, unit, *got)

    monkeypatch.setattr(HostStorage, "_fill", fill)
    monkeypatch.setattr(HostStorage, "_keep", keep)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    storage = HostStorage(model, groups(model), "pinned")
    assert state["kept"] == len(storage.units) > 2 * host_storage._CAPTURE_WORKERS
    assert state["ahead"] <= host_storage._CAPTURE_WORKERS
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
