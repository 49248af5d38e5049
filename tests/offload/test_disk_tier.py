"""The host ceiling and the disk tier: units beyond ``max_host_bytes`` streamed from their files."""

from __future__ import annotations

import copy
import errno
import os
import re

import pytest
import torch

import shuttle
from shuttle.errors import BudgetTooSmallError, FileChangedError, HostBackingError, OffloadError
from shuttle.formats.safetensors_file import SafetensorsFile
from shuttle.offload import HostStorage, ModelOffloader, StreamConfig
from shuttle.offload.disk_reader import DiskReader
from tests.offload.models import RESIDENCY_MODES, Block, TinyDiT

PATHS = ["blocks", "single"]
# All on disk but the fixed minimum; about half pinned; everything pinned.
CEILINGS = {"tight": 50_000, "half": 150_000, "roomy": 10**9}


def saved(tmp_path, model=None, name="model.safetensors"):
    """(the reference model, its file opened by its header)."""
    from safetensors.torch import save_model

    ref = model if model is not None else TinyDiT()
    save_model(ref, str(tmp_path / name))
    return ref, SafetensorsFile(tmp_path / name)


def on_meta(file, ceiling, **kw):
    """A TinyDiT built on ``meta`` and captured from ``file`` under ``ceiling``."""
    with torch.device("meta"):
        model = TinyDiT()
    return ModelOffloader.from_module(model, blocks=PATHS, max_host_bytes=ceiling,
                                      sources={k: file.tensor_ref(k) for k in file}, **kw)


def tokens():
    return torch.randint(0, 64, (2, 9))


def floor_of(capture) -> int:
    """The host floor that ``capture(max_host_bytes)`` names when given 0 bytes."""
    with pytest.raises(BudgetTooSmallError, match="give at least") as e:
        capture(0)
    return int(re.search(r"give at least (\d+) bytes", str(e.value)).group(1))


def watch_host_bytes(monkeypatch):
    """Record ``host_bytes`` of every storage after each allocation it makes."""
    seen: list[tuple[int, int | None]] = []
    for name in ("_keep", "_set_staging"):
        original = getattr(HostStorage, name)

        def spy(self, *args, _original=original):
            out = _original(self, *args)
            seen.append((self.host_bytes, self.max_host_bytes))
            return out

        monkeypatch.setattr(HostStorage, name, spy)
    return seen


@pytest.mark.parametrize("ceiling", list(CEILINGS))
@pytest.mark.parametrize("mode", list(RESIDENCY_MODES))
def test_streaming_from_disk_matches_the_resident_model(cpu_copy, tmp_path, monkeypatch, mode,
                                                        ceiling):
    seen = watch_host_bytes(monkeypatch)
    ref, file = saved(tmp_path)
    off = on_meta(file, CEILINGS[ceiling])
    storage = off.storage
    x = tokens()
    with torch.no_grad():
        want = ref(x)
        with off.use("cpu", RESIDENCY_MODES[mode]) as model:
            on_disk = [u.name for u in storage.units if u.on_disk]
            assert bool(on_disk) == (ceiling != "roomy")
            for _ in range(3):  # units on disk are read again at every load
                assert torch.equal(model(x), want)
            assert set(off.plan.pinned) == {u.name for u in storage.units if not u.on_disk}
            assert storage.host_bytes == off.plan.host_bytes
        assert (storage.reader.bytes_read > 0) == bool(on_disk)
        assert torch.equal(off.model(x), want)  # inactive: the maps of the file
    assert seen and all(used <= cap for used, cap in seen)


def test_host_bytes_stay_under_the_ceiling_through_every_plan(cpu_copy, tmp_path, monkeypatch):
    seen = watch_host_bytes(monkeypatch)
    ref, file = saved(tmp_path)
    x = tokens()
    for ceiling in (50_000, 60_000, 100_000, 200_000, 300_000):
        off = on_meta(file, ceiling)
        for stream in [StreamConfig(prefetch=2), None, StreamConfig(prefetch=1, resident=3),
                       StreamConfig(prefetch=0), StreamConfig(prefetch=2, vram_budget=150_000)]:
            with torch.no_grad(), off.use("cpu", stream) as model:
                assert torch.equal(model(x), ref(x))
            assert off.storage.host_bytes <= ceiling
    assert len(seen) > 20 and all(used <= cap for used, cap in seen)


@pytest.mark.parametrize("ceiling", list(CEILINGS))
def test_progress_counts_the_units_read_into_host_memory_during_the_capture(cpu_copy, tmp_path,
                                                                             ceiling):
    _, file = saved(tmp_path)
    told: list[int] = []
    off = on_meta(file, CEILINGS[ceiling], progress=told.append)
    held = [u for u in off.storage.units if u.arena is not None]
    assert sorted(told) == sorted(u.layout.weight_bytes for u in held)
    assert (len(held) == len(off.storage.units)) == (ceiling == "roomy")  # the rest on disk
    assert bool(told) == (ceiling != "tight")  # tight: every unit left on disk
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=0)) as model:  # a new plan
        model(tokens())
    assert len(told) == len(held)  # reads after the capture are not its progress


def test_streamed_units_are_pinned_before_resident_ones(cpu_copy, tmp_path):
    _, file = saved(tmp_path)
    off = on_meta(file, 10**9)
    storage = off.storage
    block = storage.groups["blocks"][0]
    stage = max(u.spans.nbytes for u in storage.units)  # the largest unit's read
    # A ring of prefetch + 1 = 3 staging buffers, and room for two blocks' arenas.
    storage.max_host_bytes = 3 * stage + 2 * storage.arena_bytes(block) + 100
    plan = off.plan_for(StreamConfig(prefetch=2, resident=2))
    assert plan.resident == {"blocks": (1, 3), "single": (0, 2)}
    resident = {"blocks.1", "blocks.3", "single.0", "single.2"}
    assert plan.staging[0] == 3
    assert plan.staging[1] == max(u.spans.nbytes for u in storage.units
                                  if u.name not in plan.pinned)
    # The hottest first, spread over each group: the first streamed block of each group.
    assert {"blocks.0", "single.1"} <= plan.pinned and not plan.pinned & resident
    assert plan.host_bytes <= storage.max_host_bytes
    everything = off.plan_for(None)  # nothing streams: one staging buffer, units as they fit
    assert everything.staging[0] == 1 and len(everything.pinned) >= 4


def test_a_ceiling_below_the_floor_names_it_and_changes_nothing(tmp_path):
    _, file = saved(tmp_path)
    sources = {k: file.tensor_ref(k) for k in file if not k.startswith("blocks.0.")}

    def build():  # blocks.0's tensors are in no file: it stays in host memory whole
        with torch.device("meta"):
            model = TinyDiT()
        model.blocks[0] = Block(32, 128)
        return model

    model = build()
    with pytest.raises(BudgetTooSmallError, match=r"give at least (\d+) bytes") as e:
        ModelOffloader.from_module(model, blocks=PATHS, sources=sources, max_host_bytes=1000)
    assert "blocks.0" in str(e.value)
    assert all(p.is_meta for b in model.blocks[1:] for p in b.parameters())  # nothing captured
    floor = int(re.search(r"give at least (\d+) bytes", str(e.value)).group(1))
    with pytest.raises(BudgetTooSmallError, match=f"give at least {floor} bytes"):
        ModelOffloader.from_module(build(), blocks=PATHS, sources=sources,
                                   max_host_bytes=floor - 1)
    off = ModelOffloader.from_module(model, blocks=PATHS, sources=sources, max_host_bytes=floor)
    assert off.storage.host_bytes <= floor
    assert not off.storage.groups["blocks"][0].on_disk  # kept: its tensors are in no file
    assert all(u.on_disk for u in off.storage.groups["single"])
    for stream in (None, StreamConfig(prefetch=2)):  # every plan fits the floor
        assert off.plan_for(stream).host_bytes <= floor


@pytest.mark.parametrize("mode", list(RESIDENCY_MODES))
def test_tensors_the_files_hold_otherwise_stay_beside_a_unit_on_disk(cpu_copy, tmp_path, mode):
    # blocks.1's attention weight is stored in bfloat16 for a float32 model (as diffusers keeps
    # some modules in float32 beside bfloat16 files) and blocks.2's scale is in no file: both
    # units still stream from the file, those two tensors held on the side.
    ref = TinyDiT()
    with torch.no_grad():
        ref.blocks[1].attn.weight.copy_(ref.blocks[1].attn.weight.bfloat16().float())
    stored = copy.deepcopy(ref)
    stored.blocks[1].attn.weight = torch.nn.Parameter(ref.blocks[1].attn.weight.bfloat16())
    _, file = saved(tmp_path, stored)
    sources = {k: file.tensor_ref(k) for k in file if k != "blocks.2.scale"}
    with torch.device("meta"):
        model = TinyDiT()
    model.blocks[2].scale = ref.blocks[2].scale.clone()
    off = ModelOffloader.from_module(model, blocks=PATHS, sources=sources,
                                     max_host_bytes=CEILINGS["tight"])
    storage = off.storage
    blocks = storage.groups["blocks"]
    assert all(u.on_disk for u in [*blocks, *storage.groups["single"]])
    assert [len(u.side) for u in blocks] == [0, 1, 1, 0, 0]
    assert blocks[1].side[next(iter(blocks[1].side))].dtype == torch.float32
    assert storage.side_bytes > 0 and storage.host_bytes <= CEILINGS["tight"]
    x = tokens()
    with torch.no_grad():
        want = ref(x)
        for _ in range(2):  # the second pass reads the slots again, over other units' bytes
            with off.use("cpu", RESIDENCY_MODES[mode]) as m:
                assert torch.equal(m(x), want)
                assert storage.host_bytes == off.plan.host_bytes <= CEILINGS["tight"]
        assert torch.equal(off.model(x), want)  # inactive: the file maps and the side tensors


def test_a_floor_raised_by_files_of_another_dtype_says_how_to_stream_them(tmp_path):
    # A float32 checkpoint captured as bfloat16: every tensor is converted while read, so no
    # unit can be read again from the file; the refusal says so and what to do.
    _, file = saved(tmp_path)
    sources = {k: file.tensor_ref(k) for k in file}
    with torch.device("meta"):
        model = TinyDiT(dtype=torch.bfloat16)
    needs = ModelOffloader.host_needs(model, blocks=PATHS, sources=sources)
    assert 0 < needs.converted <= needs.everything
    with pytest.raises(BudgetTooSmallError, match="another dtype") as e:
        ModelOffloader.from_module(model, blocks=PATHS, sources=sources, max_host_bytes=50_000)
    assert "shuttle cast" in str(e.value) and f"{needs.converted} of those bytes" in str(e.value)
    with torch.device("meta"):  # stored as computed: nothing held for that reason
        same = TinyDiT()
    assert ModelOffloader.host_needs(same, blocks=PATHS, sources=sources).converted == 0


@pytest.mark.parametrize("bad", [-1, float("nan"), True, "8G"])
def test_bad_ceilings_are_refused(tmp_path, bad):
    _, file = saved(tmp_path)
    with pytest.raises(OffloadError, match="max_host_bytes"):
        on_meta(file, bad)


def test_adopt_with_a_ceiling_is_refused(tmp_path):
    _, file = saved(tmp_path)
    with pytest.raises(HostBackingError, match="host='pinned'"):
        on_meta(file, 100_000, host="adopt")


@pytest.mark.parametrize("change", ["truncate", "rewrite", "replace"])
def test_a_file_changed_under_a_streaming_model_raises_and_never_gives_wrong_weights(
        cpu_copy, tmp_path, change):
    ref, file = saved(tmp_path)
    off = on_meta(file, CEILINGS["tight"])
    x = tokens()
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=1)) as model:
        assert torch.equal(model(x), ref(x))
        path = tmp_path / "model.safetensors"
        if change == "truncate":
            os.truncate(path, file.size // 2)
        elif change == "rewrite":  # same size, other bytes
            data = bytearray(path.read_bytes())
            data[-4096:] = bytes(4096)
            path.write_bytes(bytes(data))
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        else:
            saved(tmp_path, TinyDiT(), "other.safetensors")
            os.replace(tmp_path / "other.safetensors", path)
        for _ in range(2):  # again: the slot whose load failed is never used
            with pytest.raises(FileChangedError, match="model.safetensors"):
                model(x)
    assert not off.active


def test_a_file_rewritten_during_a_read_never_gives_that_forward(cpu_copy, tmp_path,
                                                                 monkeypatch):
    ref, file = saved(tmp_path)
    off = on_meta(file, 10**9)
    storage = off.storage
    storage.max_host_bytes = storage.host_bytes - 1  # now a unit or two go to disk
    x = tokens()
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=0)) as model:
        assert any(u.on_disk for u in storage.units)
        real = os.preadv
        calls = {"n": 0, "race": None}
        path = tmp_path / "model.safetensors"

        def racing(fd, buffers, offset):  # the call's last read races a writer
            calls["n"] += 1
            if calls["n"] == calls["race"]:
                with open(path, "r+b") as f:
                    f.seek(offset)
                    f.write(bytes(len(buffers[0])))
                st = os.stat(path)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", racing)
        for _ in range(2):  # the second call counts the reads of one call in steady state
            calls["n"] = 0
            assert torch.equal(model(x), ref(x))
        calls["race"], calls["n"] = calls["n"], 0
        with pytest.raises(FileChangedError, match="rewritten"):
            model(x)  # its last read saw the new bytes: this call never returns


@pytest.mark.parametrize("failing", [2, 5, 9])
def test_a_failed_read_never_lets_the_slot_be_used(cpu_copy, tmp_path, monkeypatch, failing):
    ref, file = saved(tmp_path)
    off = on_meta(file, CEILINGS["tight"])
    real = os.preadv
    calls = {"n": 0}

    def flaky(fd, buffers, offset):  # one transient I/O error
        calls["n"] += 1
        if calls["n"] == failing:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    x = tokens()
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=1)) as model:
        want = ref(x)
        assert torch.equal(model(x), want)
        monkeypatch.setattr(os, "preadv", flaky)
        raised = 0
        for _ in range(3):  # each call raises or is right: never the slot's stale bytes
            try:
                got = model(x)
            except shuttle.errors.AdapterFileError as e:
                assert "reading failed" in str(e)
                raised += 1
            else:
                assert torch.equal(got, want)
        assert raised


def test_a_read_that_ends_early_raises(tmp_path, cpu_copy, monkeypatch):
    # The file shrinks between the identity check and the read: the read comes back short.
    ref, file = saved(tmp_path)
    off = on_meta(file, CEILINGS["tight"])
    real = os.preadv

    def short(fd, buffers, offset):
        return min(real(fd, buffers, offset), 100)  # as if the file ended 100 bytes later

    monkeypatch.setattr(os, "preadv", lambda fd, b, o: short(fd, b, o) if o > 0 else 0)
    with torch.no_grad(), pytest.raises(FileChangedError, match="became shorter"), \
            off.use("cpu", StreamConfig(prefetch=1)) as model:
        model(tokens())


def test_o_direct_is_used_where_the_filesystem_allows(cpu_copy, tmp_path, monkeypatch):
    (tmp_path / "probe").write_bytes(bytes(4096))
    try:
        os.close(os.open(tmp_path / "probe", os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("the test's filesystem refuses O_DIRECT (tmpfs?): the fallback test covers it")
    opened = []
    real = os.open
    monkeypatch.setattr(os, "open", lambda p, flags, *a: opened.append(flags) or
                        real(p, flags, *a))
    ref, file = saved(tmp_path)
    off = on_meta(file, CEILINGS["tight"])
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=1)) as model:
        x = tokens()
        assert torch.equal(model(x), ref(x))
    assert any(f & os.O_DIRECT for f in opened)


def test_a_filesystem_refusing_o_direct_is_read_buffered(cpu_copy, tmp_path, monkeypatch):
    real = os.open

    def refusing(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs answers
        return real(p, flags, *a)

    monkeypatch.setattr(os, "open", refusing)
    ref, file = saved(tmp_path)
    off = on_meta(file, CEILINGS["tight"])
    x = tokens()
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=2)) as model:
        for _ in range(2):
            assert torch.equal(model(x), ref(x))
    assert off.storage.reader._refused  # remembered: later reads go buffered at once


def test_direct_reads_refused_at_read_time_are_retried_buffered(cpu_copy, tmp_path,
                                                                 monkeypatch):
    real = os.preadv
    direct_fds = set()
    real_open = os.open

    def track(p, flags, *a):
        fd = real_open(p, flags, *a)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def refusing(fd, buffers, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")  # some FUSE filesystems
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "open", track)
    monkeypatch.setattr(os, "preadv", refusing)
    ref, file = saved(tmp_path)
    off = on_meta(file, CEILINGS["tight"])
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=1)) as model:
        x = tokens()
        assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_adapters_apply_to_units_read_from_disk(cpu_copy, tmp_path, mode):
    from tests.offload.test_lora_offload import adapters

    ref, file = saved(tmp_path)
    loras = adapters()
    merged = copy.deepcopy(ref)
    shuttle.merge_lora(merged, loras)
    off = on_meta(file, CEILINGS["tight"])
    x = tokens()
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=1), loras=loras,
                                  mode=mode) as model:
        for _ in range(2):
            got = model(x)
            if mode == "merge":
                assert torch.equal(got, merged(x))
            else:
                torch.testing.assert_close(got, merged(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(off.model(x), ref(x))  # the file was never written


def test_layer_mode_streams_layers_from_disk(cpu_copy, tmp_path):
    ref, file = saved(tmp_path)

    def capture(ceiling):
        with torch.device("meta"):
            model = TinyDiT()
        return ModelOffloader.from_module(model, layers=True, max_host_bytes=ceiling,
                                          sources={k: file.tensor_ref(k) for k in file})

    ceiling = floor_of(capture) + 20_000
    off = capture(ceiling)
    assert any(u.on_disk for u in off.storage.layers)
    x = tokens()
    for stream in [StreamConfig(prefetch=1), StreamConfig(prefetch=2, resident=4), None]:
        with torch.no_grad(), off.use("cpu", stream) as m:
            for _ in range(2):
                assert torch.equal(m(x), ref(x))
        assert off.storage.host_bytes <= ceiling


def test_cpu_pass_through_reads_the_file_maps(tmp_path):
    ref, file = saved(tmp_path)
    off = on_meta(file, CEILINGS["tight"])
    with torch.no_grad(), off.use("cpu") as m:
        x = tokens()
        assert torch.equal(m(x), ref(x))
    assert off.storage.reader.bytes_read == 0


def test_training_through_disk_units_with_trainable_device(cpu_copy, tmp_path):
    from tests.offload.test_training import _lora_dit, train_alike

    ref = _lora_dit(accelerated=False)
    frozen = {n: p.detach() for n, p in ref.named_parameters() if not p.requires_grad}
    frozen |= {n: b for n, b in ref.named_buffers()}
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in frozen.items() if k != "head.weight"},
              str(tmp_path / "base.safetensors"))
    file = SafetensorsFile(tmp_path / "base.safetensors")
    model = copy.deepcopy(ref)
    off = ModelOffloader.from_module(model, blocks=PATHS, trainable="device",
                                     sources={k: file.tensor_ref(k) for k in file},
                                     max_host_bytes=60_000)
    assert sum(u.on_disk for u in off.storage.units) >= 4
    train_alike(ref, off, StreamConfig(prefetch=1))
    assert off.storage.reader.bytes_read > 0
    got = dict(off.model.named_parameters())
    for n, q in ref.named_parameters():
        torch.testing.assert_close(got[n], q, rtol=1e-5, atol=1e-6, msg=n)


def test_a_host_optimizer_step_on_a_unit_on_disk_is_refused(cpu_copy, tmp_path):
    from shuttle.errors import StreamModeError

    ref, file = saved(tmp_path)
    off = on_meta(file, CEILINGS["tight"])
    opt = torch.optim.SGD(off.model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in off.model.named_parameters()}
    with (off.use("cpu", StreamConfig(prefetch=1)),
          pytest.raises(StreamModeError, match="trainable='device'"), off.optimizer_step()):
        opt.step()
    for n, p in off.model.named_parameters():
        assert torch.equal(p, before[n]), n
    del ref


def test_a_unit_updated_by_a_host_step_is_never_dropped_again(cpu_copy, tmp_path):
    ref, file = saved(tmp_path)
    off = on_meta(file, 10**9)  # everything pinned: host steps are allowed
    for name, p in off.model.named_parameters():
        p.requires_grad_(name.startswith("blocks.1."))
    opt = torch.optim.SGD([p for p in off.model.parameters() if p.requires_grad], lr=0.5)
    x = tokens()
    with off.use("cpu", StreamConfig(prefetch=1)) as model:
        from tests.offload.test_training import checkpointed

        checkpointed(model, x).sum().backward()
        with off.optimizer_step():
            opt.step()
            opt.zero_grad()
    updated = off.storage.groups["blocks"][1]
    assert updated.spans is None and updated in off.storage.fixed
    off.storage.max_host_bytes = off.storage.arena_bytes(updated) + 100_000
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=1)) as model:
        assert not updated.on_disk  # its file holds the weights before the step
        assert off.storage.groups["blocks"][2].on_disk  # the ceiling now spills the others
        stepped = model(x)
    ref.blocks[1].load_state_dict(off.model.blocks[1].state_dict())
    with torch.no_grad():
        assert torch.equal(stepped, ref(x))  # the updated weights, not the file's


def test_a_reader_without_buffers_is_a_bug_not_a_silent_copy():
    with pytest.raises(AssertionError, match="staging"):
        DiskReader().submit(None, None, None)


_RSS_CHILD = """
import json, os, sys
import torch
from torch import nn
from shuttle.formats.safetensors_file import SafetensorsFile
from shuttle.offload import ModelOffloader, StreamConfig

def status(key):
    return int(next(line.split()[1] for line in open("/proc/self/status")
                    if line.startswith(key))) * 1024

path, ceiling = sys.argv[1], int(sys.argv[2])
file = SafetensorsFile(path)
with torch.device("meta"):
    model = nn.Sequential(nn.Linear(8, 2048), nn.Sequential(*[nn.Linear(2048, 2048)
                                                              for _ in range(8)]))
x = torch.ones(1, 8)
torch.nn.functional.linear(torch.ones(1, 2048), torch.ones(4, 2048))  # warm the allocator
if torch.cuda.is_available():  # the CUDA context (pinning registers memory) is no host tier
    torch.cuda.init()
    torch.empty(1, device="cuda")
baseline = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from here
off = ModelOffloader.from_module(model, blocks=["1"], sources={k: file.tensor_ref(k)
                                                               for k in file},
                                 max_host_bytes=ceiling)
with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=1)) as m:
    outs = [m(x).sum().item() for _ in range(2)]
print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "outs": outs,
                  "host": off.storage.host_bytes, "device": off.plan_for(
                      StreamConfig(prefetch=1)).device_bytes,
                  "read": off.storage.reader.bytes_read}))
"""


def test_peak_rss_stays_within_the_ceiling_in_a_fresh_process(tmp_path):
    import json
    import subprocess
    import sys

    from safetensors.torch import save_model
    from torch import nn

    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 2048), nn.Sequential(*[nn.Linear(2048, 2048)
                                                                  for _ in range(8)]))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():  # cheaper than the default init; 128 MiB in all
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    save_model(model, str(tmp_path / "big.safetensors"))
    weights = sum(p.nbytes for p in model.parameters())
    with torch.no_grad():
        want = model(torch.ones(1, 8)).sum().item()
    del model
    ceiling = 32 * 2**20
    env = dict(os.environ, SHUTTLE_OFFLOAD_CPU_COPY="1",
               PYTHONPATH=os.pathsep.join(entry for entry in sys.path if entry))
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(tmp_path / "big.safetensors"),
                          str(ceiling)], env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["outs"] == [want, want]
    assert got["host"] <= ceiling and got["read"] >= 2 * (weights - ceiling)
    # The CPU copy path's "device" slots live in host memory too; the rest is the allowance
    # for the interpreter's own allocations (threads, activations, allocator slack).
    allowance = 48 * 2**20
    assert got["peak"] - got["baseline"] <= ceiling + got["device"] + allowance, got


def test_host_needs_states_the_floor_and_everything_without_capturing(tmp_path):
    _, file = saved(tmp_path)
    sources = {k: file.tensor_ref(k) for k in file}
    del sources["blocks.0.scale"]

    def build():
        with torch.device("meta"):
            model = TinyDiT()
        model.blocks[0].scale = torch.ones(32)
        return model

    model = build()
    needs = ModelOffloader.host_needs(model, blocks=PATHS, sources=sources)
    assert all(p.is_meta for p in model.parameters())  # nothing captured
    assert needs.floor == floor_of(lambda c: ModelOffloader.from_module(
        build(), blocks=PATHS, sources=sources, max_host_bytes=c))
    # everything: every unit in an arena, beside the side arena a ceiling allocates (blocks.0's
    # scale, in no file); without a ceiling there is no side arena
    full = ModelOffloader.from_module(build(), blocks=PATHS, sources=sources,
                                      max_host_bytes=needs.everything)
    assert needs.everything == full.storage.host_bytes > needs.floor
    side = full.storage.side_bytes
    assert not any(u.on_disk for u in full.storage.units) and side >= 128
    free = ModelOffloader.from_module(build(), blocks=PATHS, sources=sources)
    assert free.storage.host_bytes == needs.everything - side and free.storage.side_bytes == 0


def test_a_ceiling_of_everything_keeps_everything_in_memory(cpu_copy, tmp_path):
    ref, file = saved(tmp_path)
    with torch.device("meta"):
        probe = TinyDiT()
    everything = ModelOffloader.host_needs(probe, blocks=PATHS, sources={
        k: file.tensor_ref(k) for k in file}).everything
    off = on_meta(file, everything)  # no room for staging beside it: none is needed
    x = tokens()
    with torch.no_grad(), off.use("cpu", StreamConfig(prefetch=2)) as m:
        assert torch.equal(m(x), ref(x))
        assert off.plan.staging == (0, 0) and not any(u.on_disk for u in off.storage.units)
    assert off.storage.reader.bytes_read == 0 and off.storage.host_bytes == everything


def test_a_plan_for_another_host_tier_is_refused_before_anything_changes(cpu_copy, tmp_path):
    import dataclasses

    _, file = saved(tmp_path)
    off = on_meta(file, CEILINGS["half"])
    plan = off.plan_for(StreamConfig(prefetch=1))
    before = {u.name: u.on_disk for u in off.storage.units}
    off.storage.max_host_bytes = plan.host_bytes - 1  # the plan no longer fits the ceiling
    with pytest.raises(OffloadError, match="host tier"):
        off.activate("cpu", plan=plan)
    off.storage.max_host_bytes = CEILINGS["half"]
    for bad in (dataclasses.replace(plan, pinned=None),  # made without a host tier
                dataclasses.replace(plan, pinned=plan.pinned | {"nowhere"}),
                dataclasses.replace(plan, staging=(0, 0))):
        with pytest.raises(OffloadError, match="host tier"):
            off.activate("cpu", plan=bad)
    assert not off.active and before == {u.name: u.on_disk for u in off.storage.units}
    with off.use("cpu", plan=plan):
        pass
