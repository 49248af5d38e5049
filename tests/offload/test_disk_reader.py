"""The disk tier's reads: extents, chunks and copies, the staging ring, and its ordering."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from shuttle.errors import AdapterFileError
from shuttle.formats.safetensors_file import SafetensorsFile
from shuttle.offload import Layout, SlotPool
from shuttle.offload.arena import new_arena as _arena
from shuttle.offload.disk_reader import _GAP, IO_ALIGN, DiskReader, DiskSpans, read_bandwidth


def checkpoint(tmp_path):
    """Two files: tensors of several dtypes and sizes, small ones between large gaps."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    a = {"a.big": torch.randn(3000, generator=g),  # 12 000 bytes: several blocks
         "a.gap": torch.zeros(_GAP // 2 + 4096, dtype=torch.uint8),  # not read: in a gap
         "a.half": torch.randn(17, 5, generator=g).half(),
         "a.int": torch.arange(7, dtype=torch.int64),
         "z.far": torch.randn(5, generator=g),
         "y.skip": torch.zeros(2 * _GAP, dtype=torch.uint8)}  # a gap too large to read through
    b = {"b.one": torch.randn(1, generator=g), "b.mat": torch.randn(40, 30, generator=g).bfloat16()}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    fa, fb = (SafetensorsFile(tmp_path / f"{n}.safetensors") for n in "ab")
    # The unit's tensors in an order of its own (a layout is in module order, not file order).
    refs = [fb.tensor_ref("b.mat"), fa.tensor_ref("a.int"), fa.tensor_ref("z.far"),
            fa.tensor_ref("a.big"), fb.tensor_ref("b.one"), fa.tensor_ref("a.half")]
    values = [b["b.mat"], a["a.int"], a["z.far"], a["a.big"], b["b.one"], a["a.half"]]
    layout = Layout.of([(t.dtype, t.shape) for t in refs])
    return DiskSpans(list(zip(layout.offsets, refs, strict=True))), layout, values


@pytest.mark.parametrize("capacity", [IO_ALIGN, 2 * IO_ALIGN, 5 * IO_ALIGN, 1 << 20])
def test_chunks_read_and_copy_every_tensor_into_its_layout_place(tmp_path, capacity):
    spans, layout, values = checkpoint(tmp_path)
    assert spans.nbytes % IO_ALIGN == 0
    assert spans.nbytes < 8 * IO_ALIGN  # the gap of y.skip is not read, a.gap is read through
    flat = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    chunks = spans.chunks(capacity)
    assert len(chunks) == -(-spans.nbytes // capacity)
    for chunk in chunks:
        buffer = torch.zeros(capacity, dtype=torch.uint8)
        for r in chunk.reads:  # aligned for O_DIRECT: offsets, places and lengths
            assert r.offset % IO_ALIGN == r.at % IO_ALIGN == r.length % IO_ALIGN == 0
            assert r.at + r.length <= capacity and r.need <= r.length
            data = r.file.path.read_bytes()[r.offset:r.offset + r.length]
            assert len(data) >= r.need  # only the widening may lie past the file's end
            buffer[r.at:r.at + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for c in chunk.copies:
            assert c.at + c.n <= capacity
            flat[c.to:c.to + c.n] = buffer[c.at:c.at + c.n]
    for got, want in zip(layout.views(flat), values, strict=True):
        assert torch.equal(got, want)


def staging(n, capacity):
    return [_arena(capacity, pin=True) for _ in range(n)]


def gated(monkeypatch):
    """Reads wait for ``gate`` (set it to let them through)."""
    gate = threading.Event()
    real = DiskReader._read

    def read(self, chunk, b):
        assert gate.wait(30), "the gate was never opened"  # a guard against a hang only
        return real(self, chunk, b)

    monkeypatch.setattr(DiskReader, "_read", read)
    return gate


def test_a_load_returns_before_its_read_and_is_landed_when_waited_for(tmp_path, monkeypatch):
    spans, layout, values = checkpoint(tmp_path)
    gate = gated(monkeypatch)
    reader = DiskReader()
    reader.set_buffers(staging(2, spans.nbytes), cuda=False)
    landed = []
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)

    def land(buffer, copies, first, last, staged):
        landed.append((first, last))
        for c in copies:
            flat[c.to:c.to + c.n] = buffer[c.at:c.at + c.n]

    load = reader.submit("pool", spans, land)
    reader.pump()
    assert not landed and not load.done and reader.busy  # queued, read in the background
    gate.set()
    reader.finish(load)
    assert landed == [(True, True)] and load.done and not reader.busy
    assert all(torch.equal(g, w) for g, w in zip(layout.views(flat), values, strict=True))


def test_reads_wait_for_a_free_staging_buffer_and_land_in_order(tmp_path, monkeypatch):
    spans, layout, values = checkpoint(tmp_path)
    reader = DiskReader()
    reader.set_buffers(staging(2, IO_ALIGN), cuda=False)  # small buffers: many chunks
    order = []
    flats = [torch.zeros(layout.nbytes, dtype=torch.uint8) for _ in range(3)]

    def land_into(k):
        def land(buffer, copies, first, last, staged):
            order.append(k)
            for c in copies:
                flats[k][c.to:c.to + c.n] = buffer[c.at:c.at + c.n]
        return land

    loads = [reader.submit("pool", spans, land_into(k)) for k in range(3)]
    reader.finish(loads[2])  # the last one: every earlier chunk lands first, in order
    n = len(spans.chunks(IO_ALIGN))
    assert n > 1 and order == [0] * n + [1] * n + [2] * n
    for flat in flats:
        assert all(torch.equal(g, w) for g, w in zip(layout.views(flat), values, strict=True))
    assert reader.bytes_read == 3 * spans.nbytes


def test_draining_a_pool_drops_its_loads_and_lands_nothing_of_them(tmp_path, monkeypatch):
    spans, _, _ = checkpoint(tmp_path)
    gate = gated(monkeypatch)
    reader = DiskReader()
    reader.set_buffers(staging(1, IO_ALIGN), cuda=False)
    landed = []
    mine = reader.submit("mine", spans, lambda *a: landed.append("mine"))
    other = reader.submit("other", spans, lambda *a: landed.append("other"))
    gate.set()
    reader.drain("mine")
    assert "mine" not in landed and mine.done
    reader.finish(other)
    assert landed and set(landed) == {"other"} and not reader.busy


def test_a_pool_load_from_disk_lands_at_wait_loaded(cpu_copy, tmp_path, monkeypatch):
    from tests.offload.test_disk_tier import on_meta, saved

    _, file = saved(tmp_path)
    unit = on_meta(file, 50_000).storage.groups["blocks"][2]
    assert unit.on_disk
    gate = gated(monkeypatch)
    pool = SlotPool(unit.layout, 2, torch.device("cpu"))
    pool.buffers[0].fill_(7)
    pool.load(0, unit)
    pool.release(1)  # any pool call lands what finished, and waits for nothing
    assert bool((pool.buffers[0] == 7).all())  # nothing copied while the read waits
    gate.set()
    pool.wait_loaded(0)
    want = [src.load() for src in unit.survey.files]
    assert all(torch.equal(g, w) for g, w in zip(pool.views[0], want, strict=True))
    pool.close()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("workers", [1, 3])
def test_read_bandwidth_reads_the_bytes_asked_in_pieces_on_its_workers(tmp_path, monkeypatch,
                                                                       direct, workers):
    # 2.5 pieces of 64 KiB: three reads, the last short; nbytes beyond the file reads it all.
    monkeypatch.setattr("shuttle.offload.disk_reader._PIECE", 1 << 16)
    path = tmp_path / "w.bin"
    path.write_bytes(torch.randint(0, 255, (5 << 15,), dtype=torch.uint8).numpy().tobytes())
    reads: list[tuple[int, int, str]] = []
    pread = os.preadv

    def counted(fd, views, offset):
        got = pread(fd, views, offset)
        reads.append((offset, got, threading.current_thread().name))
        return got

    monkeypatch.setattr(os, "preadv", counted)
    speed = read_bandwidth(path, 1 << 30, workers=workers, direct=direct)
    assert speed > 0
    assert sorted(r[:2] for r in reads) == [(0, 1 << 16), (1 << 16, 1 << 16), (2 << 16, 1 << 15)]
    assert len({r[2] for r in reads}) <= workers
    reads.clear()
    read_bandwidth(path, 1000, workers=workers, direct=direct)  # one block, rounded up
    assert [r[:2] for r in reads] == [(0, IO_ALIGN)]


def test_read_bandwidth_refuses_a_missing_file_and_bad_counts(tmp_path):
    with pytest.raises(AdapterFileError, match="cannot be read"):
        read_bandwidth(tmp_path / "missing.safetensors")
    (tmp_path / "w.bin").write_bytes(b"x" * 4096)
    with pytest.raises(ValueError, match="at least 1"):
        read_bandwidth(tmp_path / "w.bin", workers=0)
