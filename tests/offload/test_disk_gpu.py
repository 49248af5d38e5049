"""The disk tier on the GPU: units read from their files through the pinned staging ring, with
outputs equal bit for bit to the resident model's.

The first test runs blocks of real size (16 MiB each, bf16) through every kind of host tier:
everything but the staging ring on disk, half of it pinned, and staging buffers smaller than a
block (each load read in several chunks), plain and with ``compress="lossless"`` (the pinned
units kept coded, decoded on the device beside units read plain from disk). The second makes a
race between the reader, the copy stream and the compute stream likely rather than lucky (as
test_stress_gpu.py does for arenas): one side slowed with ``torch.cuda._sleep``, either every
block's forward (copies run ahead: a copy that does not wait for its slot's last reader
overwrites weights in use) or every copy out of a staging buffer (reads run ahead: a read that
does not wait for the copies out of its buffer overwrites bytes still to be copied), 100 steps
queued without a host synchronization, inputs rotating, each step's output compared at the end.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shuttle.formats.safetensors_file import SafetensorsFile
from shuttle.offload import ModelOffloader, SlotPool, StreamConfig
from tests.offload.test_stress_gpu import (
    SLEEP,
    Net,
    SleepyBlock,
    assert_all_equal,
    references,
    run_steps,
)

pytestmark = pytest.mark.gpu

DIM, HIDDEN, N_BLOCKS = 1024, 4096, 6  # 16 MiB per block in bf16, 96 MiB of blocks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def saved(tmp_path, model: nn.Module) -> SafetensorsFile:
    from safetensors.torch import save_model

    save_model(model, str(tmp_path / "model.safetensors"))
    return SafetensorsFile(tmp_path / "model.safetensors")


def captured(cls, file: SafetensorsFile, ceiling: int, dtype=None, compress=None
             ) -> ModelOffloader:
    with torch.device("meta"):
        model = cls() if dtype is None else cls().to(dtype)
    return ModelOffloader.from_module(model, blocks=["blocks"], max_host_bytes=ceiling,
                                      sources={k: file.tensor_ref(k) for k in file},
                                      compress=compress)


BLOCK = 2 * DIM * HIDDEN * 2  # bytes of one block's matrices in bf16
TIERS = {  # ceiling, smallest staging buffer
    "disk": (BLOCK + 4 * 2**20, None),  # the staging ring and little else
    "half": (4 * BLOCK, None),  # a ring and about half of the blocks pinned
    "chunks": (3 * 2**20 + 2**20, 2**20),  # 1 MiB buffers: 16+ chunks per block load
}


@pytest.mark.parametrize("stream", [StreamConfig(prefetch=0), StreamConfig(prefetch=2),
                                    StreamConfig(prefetch=1, vram_budget=4 * BLOCK), None],
                         ids=["prefetch0", "prefetch2", "budget", "whole"])
@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("compress", [None, "lossless"])
def test_streaming_from_disk_is_bit_identical_at_real_block_sizes(tmp_path, monkeypatch, tier,
                                                                 stream, compress):
    """With compress, the pinned units are kept coded (decoded on the device) beside units
    read plain from the file."""
    ceiling, smallest = TIERS[tier]
    if smallest is not None:
        monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", smallest)
        monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", smallest)
    torch.manual_seed(0)
    ref = Big().to(torch.bfloat16)
    file = saved(tmp_path, ref)
    ref = ref.cuda().eval()
    off = captured(Big, file, ceiling, torch.bfloat16, compress)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 64, DIM, generator=g).to("cuda", torch.bfloat16) for _ in range(3)]
    want = references(ref, inputs)
    with off.use("cuda", stream) as model:
        storage = off.storage
        assert storage.pinned  # arenas and staging page-locked
        assert storage.host_bytes <= ceiling and any(u.on_disk for u in storage.units)
        if smallest is not None:
            assert storage.staging[1] < BLOCK  # a block is read in chunks
        outs = run_steps(model, inputs, steps=6)
        assert_all_equal(outs, want)
        if compress and tier == "half":
            assert any(u.code is not None and not u.on_disk for u in storage.units)
    assert storage.reader.bytes_read >= 2 * BLOCK


class Float32NormBlock(Block):
    """Its norm kept in float32 beside bf16 matrices (as diffusers keeps Wan's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x.float()).to(x.dtype)
        return x + self.down(torch.nn.functional.gelu(self.up(h)))


class KeptFloat32(Big):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Float32NormBlock() for _ in range(N_BLOCKS))


def kept_float32(model: KeptFloat32) -> KeptFloat32:
    model.to(torch.bfloat16)
    for b in model.blocks:
        b.norm.float()
    return model


@pytest.mark.parametrize("stream", [StreamConfig(prefetch=0), StreamConfig(prefetch=2)],
                         ids=["prefetch0", "prefetch2"])
@pytest.mark.parametrize("tier", ["disk", "chunks"])
def test_tensors_held_beside_units_on_disk_land_after_their_reads(tmp_path, monkeypatch, tier,
                                                                  stream):
    """Each block's float32 norm, stored in bf16, is held on the side and copied into the
    slot after the block's read (on the copy stream, after every run out of staging)."""
    ceiling, smallest = TIERS[tier]
    if smallest is not None:
        monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", smallest)
        monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", smallest)
    torch.manual_seed(0)
    ref = KeptFloat32()
    with torch.no_grad():
        for b in ref.blocks:  # random norms, exact in bf16
            b.norm.weight.normal_(1, 0.2)
            b.norm.bias.normal_(0, 0.2)
    file = saved(tmp_path, ref.to(torch.bfloat16))
    ref = kept_float32(ref).cuda().eval()
    with torch.device("meta"):
        model = kept_float32(KeptFloat32())
    off = ModelOffloader.from_module(model, blocks=["blocks"], max_host_bytes=ceiling,
                                     sources={k: file.tensor_ref(k) for k in file})
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 64, DIM, generator=g).to("cuda", torch.bfloat16) for _ in range(3)]
    want = references(ref, inputs)
    with off.use("cuda", stream) as m:
        blocks = off.storage.groups["blocks"]
        assert all(len(u.side) == 2 for u in blocks) and sum(u.on_disk for u in blocks) >= 4
        assert off.storage.host_bytes <= ceiling
        assert_all_equal(run_steps(m, inputs, steps=6), want)


@pytest.fixture(params=["slow_compute", "slow_copies"])
def slowed(request, monkeypatch):
    """Block forwards slowed, or every copy out of a staging buffer (on the copy stream)."""
    if request.param == "slow_compute":
        monkeypatch.setattr(SleepyBlock, "sleep", SLEEP)
    else:
        land = SlotPool._land

        def slow_land(self, slot, unit, buffer, copies, first, last, staged):
            with torch.cuda.stream(self._stream):
                torch.cuda._sleep(SLEEP)  # queued on the copy stream, before the copies
            land(self, slot, unit, buffer, copies, first, last, staged)

        monkeypatch.setattr(SlotPool, "_land", slow_land)
    return request.param


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_disk_streaming_under_stress(tmp_path, monkeypatch, slowed, prefetch, chunked):
    if chunked:  # 64 KiB buffers: every block load is several chunks through two buffers
        monkeypatch.setattr("shuttle.offload.spill.MIN_STAGING", 2**16)
        monkeypatch.setattr("shuttle.offload.residency.MIN_STAGING", 2**16)
    ref = Net(seed=0).cuda()
    file = saved(tmp_path, Net(seed=0))
    block = max(u.spans.nbytes for u in captured(lambda: Net(seed=0), file, 10**12)
                .storage.units if u.spans is not None)
    ceiling = 2**16 * (prefetch + 1) if chunked else block * (prefetch + 1)
    off = captured(lambda: Net(seed=0), file, ceiling)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(4, 16, 128, generator=g).cuda() for _ in range(5)]
    want = references(ref, inputs)
    with off.use("cuda", StreamConfig(prefetch=prefetch)) as model:
        assert all(u.on_disk for u in off.storage.units)
        n, size = off.storage.staging
        assert (n, size) == (prefetch + 1, block) or chunked and n == 2 and size < block / 2
        outs = run_steps(model, inputs, steps=100)
        assert_all_equal(outs, want)
