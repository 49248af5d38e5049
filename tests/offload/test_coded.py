"""compress="lossless": units kept coded in host memory, decoded as they land, bit for bit."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch

import shuttle
from shuttle.errors import (
    BudgetTooSmallError,
    CorruptCodeError,
    HostBackingError,
    StreamModeError,
)
from shuttle.kernels import exponent_decode
from shuttle.offload import ModelOffloader, StreamConfig
from shuttle.offload.coded import DECODE_STREAM_ENV, Decoder, stages
from shuttle.offload.residency import floor_bytes
from tests import assert_bits_equal
from tests.offload.models import Block, TinyDiT

MODES = {
    "whole": None,
    "stream0": StreamConfig(prefetch=0),
    "stream2": StreamConfig(prefetch=2),
    "resident": StreamConfig(prefetch=1, resident=2),
}


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setattr(exponent_decode, "interpreting", lambda: False)  # CPU: the reference


def model(**kw) -> TinyDiT:
    torch.manual_seed(0)
    m = TinyDiT(dim=128, n_blocks=3, n_single=2, dtype=torch.bfloat16, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    return m.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))


def captured(**kw) -> tuple[TinyDiT, ModelOffloader]:
    ref = model()
    return ref, ModelOffloader.from_module(copy.deepcopy(ref), blocks=["blocks", "single"],
                                           compress="lossless", **kw)


@pytest.mark.parametrize("mode", list(MODES))
def test_streamed_outputs_equal_the_resident_model(cpu_copy, mode):
    ref, off = captured()
    want = ref(tokens())
    with off.use("cpu", MODES[mode]) as m:
        assert_bits_equal(m(tokens()), want)
        assert_bits_equal(m(tokens()), want)  # the ring refilled: decoded again


def test_host_memory_holds_the_code(cpu_copy):
    ref, off = captured()
    plain = ModelOffloader.from_module(copy.deepcopy(ref), blocks=["blocks", "single"])
    coded = [u for u in off.storage.units if u.code is not None]
    assert len(coded) == 5  # every block; the rest (embedding, norms) does not gain enough
    assert off.storage.host_bytes < 0.8 * plain.storage.host_bytes
    # inactive: a coded weight has no host copy and reads NaN; active: the exact weights
    up = off.model.blocks[0].up.weight
    assert up.isnan().all()
    with off.use("cpu", StreamConfig(prefetch=1)):
        pass
    assert up.isnan().all()
    assert_bits_equal(off.model.norm.weight, ref.norm.weight)  # raw entries stay readable


def test_cpu_pass_through_decodes(monkeypatch):
    ref, off = captured()
    with off.use("cpu") as m:
        assert_bits_equal(m(tokens()), ref(tokens()))
    assert off.model.blocks[0].up.weight.isnan().all()  # the decoded copies were dropped


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_adapters_act_on_decoded_slots(cpu_copy, mode):
    from tests import lowrank_state

    ref = model()
    shapes = {f"blocks.{i}.up": (512, 128) for i in range(3)}
    lora = shuttle.load_lora(lowrank_state(shapes, rank=4, scale=0.05))
    plain = ModelOffloader.from_module(copy.deepcopy(ref), blocks=["blocks", "single"])
    coded = ModelOffloader.from_module(copy.deepcopy(ref), blocks=["blocks", "single"],
                                       compress="lossless")
    outs = []
    for off in (plain, coded):
        with off.use("cpu", StreamConfig(prefetch=1), loras=[(lora, 0.7)], mode=mode) as m:
            outs.append(m(tokens()))
    assert_bits_equal(outs[1], outs[0])
    assert not torch.equal(outs[0], ref(tokens()))  # the adapter did act


def test_the_plan_counts_the_staging_buffer(cpu_copy):
    _, off = captured()
    stage = off.storage.stage_bytes
    assert stage == stages() * max(u.code.nbytes for u in off.storage.units if u.code is not None)
    floor = floor_bytes(off.storage)
    sizes = [u.layout.nbytes for u in off.storage.groups["blocks"]]
    single = [u.layout.nbytes for u in off.storage.groups["single"]]
    assert floor == off.storage.rest.layout.nbytes + max(sizes) + max(single) + stage
    off.plan_for(StreamConfig(prefetch=0, vram_budget=floor))
    with pytest.raises(BudgetTooSmallError):
        off.plan_for(StreamConfig(prefetch=0, vram_budget=floor - 1))


@pytest.mark.parametrize("mode", ["whole", "stream0"])
def test_a_module_moved_whole_is_staged_run_by_run(cpu_copy, monkeypatch, mode):
    """The rest of a model (here all of it: no block lists, as a text encoder moved whole)
    is not staged on the device in one piece: the decoder's buffers take its largest entry (or
    RUN_BYTES) and the arena is copied and decoded run by run, bit for bit."""
    from shuttle.offload import host_storage

    monkeypatch.setattr(host_storage, "RUN_BYTES", 1)  # runs of one entry at least
    ref = model()
    off = ModelOffloader.from_module(copy.deepcopy(ref), compress="lossless")
    rest = off.storage.rest
    assert rest.code is not None and not off.storage.groups
    largest = rest.code.largest_entry(rest.layout)
    assert off.storage.stage_unit_bytes == largest < rest.code.nbytes // 4
    staged = []
    real = Decoder.stage

    def stage(self):
        staged.append(self.stages[0].numel())
        return real(self)
    monkeypatch.setattr(Decoder, "stage", stage)
    with off.use("cpu", MODES[mode]) as m:
        assert_bits_equal(m(tokens()), ref(tokens()))
    runs = rest.code.pieces(rest.layout, largest)
    assert len(staged) == len(runs) > 4 and set(staged) == {largest}


def test_pieces_cover_the_arena_in_order_within_the_limit():
    _, off = captured()
    unit = next(u for u in off.storage.units if u.code is not None)
    code, layout = unit.code, unit.layout
    sizes = [code._size(layout, i) for i in range(len(code.offsets))]
    for limit in (1, max(sizes), 3 * max(sizes), code.nbytes):
        runs = code.pieces(layout, limit)
        assert [i for _, _, entries in runs for i in entries] == list(range(len(sizes)))
        for start, end, entries in runs:
            assert start == code.offsets[entries[0]]
            assert end == code.offsets[entries[-1]] + sizes[entries[-1]]
            assert end - start <= limit or len(entries) == 1
        if limit == code.nbytes:
            assert len(runs) == 1


def test_a_budget_that_one_staging_buffer_fits_names_that_fix(cpu_copy, monkeypatch):
    """Below the floor with the decode stream's two staging buffers but not with one: the
    refusal names both floors and SHUTTLE_DECODE_STREAM=0, which then plans that budget."""
    monkeypatch.delenv(DECODE_STREAM_ENV, raising=False)
    _, off = captured()
    unit = off.storage.stage_unit_bytes
    two = floor_bytes(off.storage)
    budget = two - unit // 2
    with pytest.raises(BudgetTooSmallError) as e:
        off.plan_for(StreamConfig(prefetch=0, vram_budget=budget))
    msg = str(e.value)
    assert f"floor of {two} bytes" in msg and f"{2 * unit} bytes of staging" in msg
    assert f"SHUTTLE_DECODE_STREAM=0 (one staging buffer: a floor of {two - unit} bytes" in msg
    monkeypatch.setenv(DECODE_STREAM_ENV, "0")
    assert off.plan_for(StreamConfig(prefetch=0, vram_budget=budget)).device_bytes <= budget


def test_the_decode_stream_is_on_by_default_and_stages_in_two_buffers(cpu_copy, monkeypatch):
    """By default the plan counts two staging buffers (one fills while the other decodes on
    the decode stream); ``SHUTTLE_DECODE_STREAM=0`` counts one; outputs stay the resident
    model's either way."""
    monkeypatch.delenv(DECODE_STREAM_ENV, raising=False)
    _, off = captured()
    two = off.storage.stage_bytes
    assert two == 2 * off.storage.stage_unit_bytes > 0
    monkeypatch.setenv(DECODE_STREAM_ENV, "0")
    assert off.storage.stage_bytes == off.storage.stage_unit_bytes
    ref, off = captured()
    with off.use("cpu", MODES["stream2"]) as m:
        assert_bits_equal(m(tokens()), ref(tokens()))


def test_a_damaged_host_code_is_refused_when_the_activation_ends(cpu_copy):
    _, off = captured()
    unit = off.storage.groups["blocks"][1]
    i = next(i for i, rep in enumerate(unit.code.coded) if rep is not None)
    rep = unit.code.coded[i]
    at = unit.code.offsets[i]
    blob = unit.arena[at:at + rep.blob.numel()]
    dataclasses.replace(rep, blob=blob).parts().raw[100] ^= 0x21  # one value's low bits
    with pytest.raises(CorruptCodeError, match="failed their checks"), \
            off.use("cpu", StreamConfig(prefetch=1)) as m:
        m(tokens())


def test_training_on_the_host_is_refused_and_on_the_device_works(cpu_copy):
    ref = model()
    ref.requires_grad_(False)
    ref.blocks[0].up.weight.requires_grad_(True)
    off = ModelOffloader.from_module(copy.deepcopy(ref), blocks=["blocks", "single"],
                                     compress="lossless")
    with pytest.raises(StreamModeError, match="trainable='device'"), off.optimizer_step():
        pass
    dev = ModelOffloader.from_module(copy.deepcopy(ref), blocks=["blocks", "single"],
                                     compress="lossless", trainable="device")
    with dev.use("cpu") as m:  # resident: a streamed backward needs checkpointing
        m(tokens()).float().square().mean().backward()
        with dev.optimizer_step():
            pass
    assert dev.model.blocks[0].up.weight.grad is not None


@pytest.mark.parametrize("kw, match", [({"compress": "zstd"}, "expected 'lossless'"),
                                       ({"compress": "lossless", "host": "adopt"}, "pinned")])
def test_compress_refuses_what_it_cannot_do(kw, match):
    m = model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(HostBackingError, match=match):
        ModelOffloader.from_module(m, blocks=["blocks", "single"], **kw)
    for k, v in m.state_dict().items():
        assert_bits_equal(v, before[k], k)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_streamed_on_cuda_equal_the_resident_model(mode, monkeypatch):
    monkeypatch.undo()  # the Triton decoder
    ref, off = captured()
    want = ref.cuda()(tokens().cuda())
    with off.use("cuda", MODES[mode]) as m:
        for _ in range(3):  # the ring refilled: decoded again on the copy stream
            assert_bits_equal(m(tokens().cuda()), want)
    assert off.storage.pinned


@pytest.mark.gpu
def test_a_module_moved_whole_on_cuda_is_staged_run_by_run(monkeypatch):
    """Runs of one unit alternate between the two staging buffers on the decode stream: each
    run's copy waits for the decode that last read its buffer."""
    monkeypatch.undo()  # the Triton decoder
    from shuttle.offload import host_storage

    monkeypatch.setattr(host_storage, "RUN_BYTES", 1)
    ref = model()
    off = ModelOffloader.from_module(copy.deepcopy(ref), compress="lossless")
    assert off.storage.stage_unit_bytes < off.storage.rest.code.nbytes // 4
    want = ref.cuda()(tokens().cuda())
    for _ in range(2):
        with off.use("cuda") as m:
            assert_bits_equal(m(tokens().cuda()), want)


@pytest.mark.gpu
@pytest.mark.parametrize("slow", ["decodes", "compute"])
@pytest.mark.parametrize("mode", ["stream0", "stream2", "resident"])
def test_decodes_on_their_own_stream_stay_exact_when_either_side_lags(mode, slow, monkeypatch):
    """Each decode waits for its copy (and so for the slot's last reader), the block waits for
    its decode, a staging buffer is refilled only after its decode: with the decode stream or
    the blocks slowed by ~1 ms sleeps and 12 steps queued without a host sync, every output is
    the resident model's. (A missing wait shows as a step reading a half-decoded or
    overwritten slot.)
    """
    monkeypatch.undo()  # the Triton decoder
    monkeypatch.setenv(DECODE_STREAM_ENV, "1")
    sleep = 1_000_000  # GPU cycles
    if slow == "decodes":
        unpack = Decoder._unpack

        def slow_unpack(self, *args):
            torch.cuda._sleep(sleep)  # queued on the decode stream, before the decode
            unpack(self, *args)

        monkeypatch.setattr(Decoder, "_unpack", slow_unpack)
    else:
        forward = Block.forward

        def slow_forward(self, x):
            torch.cuda._sleep(sleep)
            return forward(self, x)

        monkeypatch.setattr(Block, "forward", slow_forward)
    ref, off = captured()
    x = tokens().cuda()
    with torch.no_grad():
        want = copy.deepcopy(ref).cuda()(x)
        with off.use("cuda", MODES[mode]) as m:
            outs = [m(x) for _ in range(12)]
            torch.cuda.synchronize()
    for out in outs:
        assert_bits_equal(out, want)


@pytest.mark.parametrize("ceiling", ["tight", "half", "roomy"])
def test_a_compressed_checkpoint_streams_from_disk_coded(cpu_copy, tmp_path, ceiling):
    """Units coded in their file stay on disk under a host ceiling and are read coded (fewer
    bytes), decoded in the slot; outputs bit for bit the resident model's.
    """
    from safetensors.torch import save_model

    from shuttle.weights.lossless_file import compress_file, open_decoded

    ref = model()
    save_model(ref, str(tmp_path / "plain.safetensors"))
    compress_file(tmp_path / "plain.safetensors", tmp_path / "coded.safetensors", progress=False)
    sources = open_decoded(tmp_path / "coded.safetensors").tensors
    with torch.device("meta"):
        empty = TinyDiT(dim=128, n_blocks=3, n_single=2, dtype=torch.bfloat16)
    needs = ModelOffloader.host_needs(empty, blocks=["blocks", "single"], sources=sources)
    limit = {"tight": needs.floor, "half": (needs.floor + needs.everything) // 2,
             "roomy": needs.everything}[ceiling]
    off = ModelOffloader.from_module(empty, blocks=["blocks", "single"], sources=sources,
                                     max_host_bytes=limit)
    assert all(u.code is not None for u in off.storage.groups["blocks"])
    assert off.storage.host_bytes <= limit
    want = ref(tokens())
    for stream in (StreamConfig(prefetch=1), StreamConfig(prefetch=0)):
        with off.use("cpu", stream) as m:
            assert_bits_equal(m(tokens()), want)
            assert_bits_equal(m(tokens()), want)
        assert off.storage.host_bytes <= limit
    on_disk = [u for u in off.storage.units if u.on_disk]
    assert bool(on_disk) == (ceiling != "roomy")


@pytest.mark.parametrize("ceiling", ["tight", "half", "coded_all"])
def test_plain_files_under_a_ceiling_keep_the_host_tier_coded(cpu_copy, tmp_path, ceiling):
    """compress with max_host_bytes, captured from a plain file: units on disk are sized, not
    coded, at capture; the plan counts each arena at its coded size, the arenas a plan gives
    are coded to exactly that size, and units left on disk are read plain. A ceiling that holds
    the coded model but not the plain one keeps every unit in host memory; outputs bit for bit
    the resident model's through every plan, and the same plan stays valid after the arenas
    are filled.
    """
    from safetensors.torch import save_model

    from shuttle.formats.safetensors_file import SafetensorsFile

    ref = model()
    save_model(ref, str(tmp_path / "plain.safetensors"))
    file = SafetensorsFile(tmp_path / "plain.safetensors")

    def capture(limit: int) -> ModelOffloader:
        with torch.device("meta"):
            empty = TinyDiT(dim=128, n_blocks=3, n_single=2, dtype=torch.bfloat16)
        return ModelOffloader.from_module(empty, blocks=["blocks", "single"], compress="lossless",
                                          sources={k: file.tensor_ref(k) for k in file},
                                          max_host_bytes=limit)

    roomy = capture(2**40)
    everything = roomy.storage.host_bytes  # every unit coded in host memory
    plain = ModelOffloader.from_module(copy.deepcopy(ref), blocks=["blocks", "single"])
    assert everything < 0.8 * plain.storage.host_bytes
    blocks = roomy.storage.groups["blocks"]
    assert all(u.code is not None and u.code is u.planned for u in blocks)
    assert all(u.arena.numel() == u.code.nbytes for u in blocks)  # as planned, to the byte
    with pytest.raises(BudgetTooSmallError, match="give at least") as e:
        capture(0)
    floor = int(re.search(r"give at least (\d+) bytes", str(e.value)).group(1))
    limit = {"tight": floor, "half": (floor + everything) // 2, "coded_all": everything}[ceiling]
    off = capture(limit)
    spilled = [u for u in off.storage.units if u.on_disk]
    assert all(u.code is None for u in spilled)  # sized, not coded
    assert any(u.planned is not None for u in spilled) or ceiling == "coded_all"
    want = ref(tokens())
    stage = off.storage.stage_unit_bytes  # the decoder's buffer: the largest planned arena
    assert stage == max(u.planned.nbytes for u in off.storage.units if u.planned is not None)
    plan = off.plan_for(StreamConfig(prefetch=1))
    for stream in (StreamConfig(prefetch=1), StreamConfig(prefetch=0)):
        with off.use("cpu", stream) as m:
            assert_bits_equal(m(tokens()), want)
            assert_bits_equal(m(tokens()), want)
        assert off.storage.host_bytes <= limit
    kept = [u for u in off.storage.units if u.spans is not None and not u.on_disk]
    assert any(u.code is not None for u in kept) or ceiling == "tight"
    assert all(u.code is u.planned and u.arena.numel() == (u.code or u.layout).nbytes
               for u in kept)
    with off.use("cpu", StreamConfig(prefetch=1), plan=plan) as m:  # planned before the fill
        assert_bits_equal(m(tokens()), want)
    on_disk = [u for u in off.storage.units if u.on_disk]
    assert all(u.code is None for u in on_disk)  # read plain: the file holds them so
    assert bool(on_disk) == (ceiling != "coded_all")
    assert off.storage.host_bytes <= limit < plain.storage.host_bytes
    assert off.storage.stage_unit_bytes == stage  # what the plans counted
