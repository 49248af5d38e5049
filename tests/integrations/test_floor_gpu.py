"""On the GPU: a budget bounds the measured peak (weights and activations together), block
lists whose blocks differ stream, and outputs stay the resident model's bit for bit.

* A FluxPipeline with Flux-dev's transformer width (tests/integrations/models.py) under budgets
  of 0.6x and 0.9x its transformer: every pipeline call equal to the resident pipeline's, and
  ``torch.cuda.max_memory_allocated`` over each whole call within the budget, the first call
  (every module at its floor, measured) included.
* A T5 encoder with T5-XXL's block width (its first block holds the relative attention bias, so
  the block list is not uniform) streamed through one ring at budgets below its size: equal to
  the resident encoder, peak within the budget, the ring sized by the largest streamed block.
* Flux's autoencoder decoding 1024x1024 at budgets below and above its untiled activations:
  within the budget from its first call (tiling decided from the call's prediction on
  ``meta``), and the resident decode bit for bit where it runs untiled.
* The device meter on real allocations: exact when a call sets the process peak, a lower bound
  (the largest sample) otherwise.

The tests reset the peak statistics themselves before each measured call (a user measuring a
call does the same; shuttle never resets them) and count the peak over what the process held
before the offload (earlier tests' workspaces are not the model's). Attention runs on the
flash or math kernels of scaled_dot_product_attention, whose results are deterministic (see
test_e2e_gpu.py).
"""

from __future__ import annotations

import copy
import functools
import gc
import re

import pytest
import torch

from shuttle.integrations import diffusers as shuttle_diffusers
from shuttle.integrations import transformers as shuttle_transformers
from shuttle.integrations.activations import MARGIN_MIN, MARGIN_SHARE, DeviceMeter
from tests.integrations.models import midsize_flux, run_midsize_flux

pytestmark = pytest.mark.gpu
pytest.importorskip("diffusers")

GIB = 2**30


@pytest.fixture(scope="module", autouse=True)
def deterministic_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gc.collect()
    torch.cuda.empty_cache()
    # The budgets below count everything allocated (cuBLAS workspaces of earlier tests too).
    leftover = torch.cuda.memory_allocated()
    assert leftover < 256 * 2**20, (
        f"{leftover} bytes left on the GPU by earlier tests; the largest live CUDA tensors: "
        f"{live_cuda_tensors()}")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        yield


def live_cuda_tensors(top: int = 8) -> list[tuple[int, str, tuple]]:
    """(bytes, type, shape) of the largest CUDA tensors the garbage collector can see."""
    seen = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                seen.append((obj.untyped_storage().nbytes(), type(obj).__name__, tuple(obj.shape)))
        except Exception:  # objects that fail isinstance or storage access: not ours
            continue
    return sorted(seen, reverse=True)[:top]


def nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def peak_of(fn, before: int):
    """``fn()`` and the peak device bytes allocated while it ran over ``before``, what the
    process held before the model was offloaded (earlier tests' cuBLAS workspaces and
    tensors are not the model's: its budget bounds the bytes it adds)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


@pytest.fixture(scope="module")
def flux():
    """(pipeline on the CPU, the resident pipeline's pixels)."""
    pipe = midsize_flux()
    resident = copy.deepcopy(pipe).to("cuda")
    ref = run_midsize_flux(resident)
    del resident
    gc.collect()
    torch.cuda.empty_cache()
    return pipe, ref


def test_a_flux_pipeline_at_its_floor_peaks_within_it(flux, request):
    """The smallest budget that runs, found as a user does (each refusal names a floor): the
    margins are cut to nothing there, so the caller's tensors (latents, prompt embeddings,
    the decoded image) must be counted with the call's own."""
    from shuttle.errors import BudgetTooSmallError

    original, _ = flux
    vram = 1
    for _ in range(12):  # each module can name a weights floor, then an activations floor
        pipe = copy.deepcopy(original)
        before = torch.cuda.memory_allocated()
        try:
            handle = shuttle_diffusers.offload(pipe, max_host_bytes=16 * GIB, vram_budget=vram,
                                               device="cuda", prefetch=2)
        except BudgetTooSmallError as e:
            vram = int(re.search(r"at least (\d+) bytes", str(e)).group(1))
            continue
        try:
            for call in range(2):
                _, peak = peak_of(functools.partial(run_midsize_flux, pipe), before)
                assert peak <= vram, f"call {call}: peak {peak} bytes over vram_budget={vram}"
            break
        except BudgetTooSmallError as e:
            vram = int(re.search(r"at least (\d+) bytes", str(e)).group(1))
        finally:
            handle.remove()
    else:
        pytest.fail(f"no budget ran after twelve floors (last {vram} bytes)")


@pytest.mark.parametrize("share", [0.6, 0.9])
def test_a_flux_pipeline_peaks_within_its_budget(flux, share, request):
    original, ref = flux
    pipe = copy.deepcopy(original)
    vram = int(share * nbytes(pipe.transformer))
    before = torch.cuda.memory_allocated()
    handle = shuttle_diffusers.offload(pipe, max_host_bytes=16 * GIB, vram_budget=vram,
                                       device="cuda", prefetch=2)
    request.addfinalizer(handle.remove)  # a failed call leaves no weights for the next test
    plans = []
    hook = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda m, a: plans.append(handle.offloaders["transformer"].plan))
    for call in range(3):
        out, peak = peak_of(lambda: run_midsize_flux(pipe), before)
        assert torch.equal(out, ref), f"call {call}"
        assert peak <= vram, f"call {call}: peak {peak} bytes over vram_budget={vram}"
    hook.remove()
    first, last = plans[0], plans[-1]
    assert not any(first.resident.values()) and first.prefetch == 0  # the floor, measured
    assert any(last.ring.values())  # the transformer streams at both budgets
    assert last.device_bytes + handle.reserves["transformer"] <= vram
    assert all(r is not None and r > 0 for r in handle.reserves.values())  # all measured
    handle.remove()


@pytest.fixture(scope="module")
def t5():
    """(a T5 encoder with T5-XXL's block width, 3 blocks, bf16, on the CPU; ids; the resident
    encoder's output)."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(vocab_size=1000, d_model=4096, d_kv=64, d_ff=10240, num_layers=3,
                      num_heads=64, feed_forward_proj="gated-gelu", decoder_start_token_id=0)
    model = T5EncoderModel._from_config(config, torch_dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (2, 64))
    resident = copy.deepcopy(model).to("cuda")
    with torch.no_grad():
        ref = resident(input_ids=ids.cuda()).last_hidden_state
    del resident
    gc.collect()
    torch.cuda.empty_cache()
    return model, ids, ref


@pytest.mark.parametrize("gib", [0.8, 1.1])  # its blocks take 1.16 GB
def test_a_t5_encoder_whose_first_block_differs_streams_within_its_budget(t5, gib, request):
    original, ids, ref = t5
    model = copy.deepcopy(original)
    vram = int(gib * GIB)
    before = torch.cuda.memory_allocated()
    handle = shuttle_transformers.offload(model, max_host_bytes=8 * GIB, vram_budget=vram,
                                          device="cuda", prefetch=2)
    request.addfinalizer(handle.remove)
    off = handle.offloaders["model"]
    assert list(off.blocks) == ["encoder.block"]
    sizes = [u.layout.nbytes for u in off.storage.groups["encoder.block"]]
    assert sizes[0] > sizes[1] == sizes[2]  # the relative attention bias
    rings = []

    def seen(m, a):
        s = off.streamers.get("encoder.block")
        rings.append((off.plan, s.pool.layout.nbytes if s else 0))

    hook = model.encoder.block[0].register_forward_pre_hook(seen)
    for call in range(3):
        with torch.no_grad():
            out, peak = peak_of(lambda: model(input_ids=ids.cuda()).last_hidden_state,
                                before)
        assert torch.equal(out, ref), f"call {call}"
        assert peak <= vram, f"call {call}: peak {peak} bytes over vram_budget={vram}"
    hook.remove()
    plan, slot = rings[-1]
    assert plan.ring["encoder.block"] >= 1  # it streams at both budgets
    kept = set(plan.resident["encoder.block"])
    assert slot == max(b for i, b in enumerate(sizes) if i not in kept)
    assert plan.device_bytes + handle.reserves["model"] <= vram
    handle.remove()


@pytest.fixture(scope="module")
def flux_vae():
    """(Flux's autoencoder at its real size, bf16, on the CPU; 1024x1024 latents; the resident
    decode)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
                        block_out_channels=(128, 256, 512, 512), sample_size=1024,
                        down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, use_quant_conv=False,
                        use_post_quant_conv=False).to(torch.bfloat16).eval()
    z = torch.randn(1, 16, 128, 128, dtype=torch.bfloat16)
    resident = copy.deepcopy(vae).to("cuda")
    with torch.no_grad():
        ref = resident.decode(z.cuda()).sample
    del resident
    gc.collect()
    torch.cuda.empty_cache()
    return vae, z, ref


# 1 GiB beside its weights: less than an untiled 1024x1024 decode allocates (its tensors alone
# hold 1.5 GiB at once), more than a tiled one; 4 GiB: room for the untiled decode.
@pytest.mark.parametrize(("gib", "tiled"), [(1.0, True), (4.0, False)])
def test_a_vae_decode_stays_within_its_budget_from_its_first_call(flux_vae, gib, tiled, request):
    from diffusers import DiffusionPipeline

    class VaeOnly(DiffusionPipeline):
        def __init__(self, vae):
            super().__init__()
            self.register_modules(vae=vae)

    original, z, ref = flux_vae
    vae = copy.deepcopy(original)
    vram = int(gib * GIB) + nbytes(vae)  # the VAE moves whole: its floor is its weights
    before = torch.cuda.memory_allocated()
    handle = shuttle_diffusers.offload(VaeOnly(vae), max_host_bytes=4 * GIB, vram_budget=vram,
                                       device="cuda")
    request.addfinalizer(handle.remove)
    for call in range(2):
        with torch.no_grad():
            out, peak = peak_of(lambda: vae.decode(z.cuda()).sample, before)
        assert peak <= vram, f"call {call}: peak {peak} bytes over vram_budget={vram}"
        assert vae.use_tiling is tiled, f"call {call}"  # decided before the first call
        assert torch.equal(out, ref) or tiled  # a tiled decode blends its tiles' seams
    handle.remove()


def test_the_device_meter_reads_real_allocations():
    class Transient(torch.nn.Module):
        """Allocates ``n`` bytes and frees them inside its forward (between two samples)."""

        def __init__(self, n: int):
            super().__init__()
            self.n = n

        def forward(self, x):
            t = torch.ones(self.n, dtype=torch.uint8, device=x.device)
            return x + t[:1]

    n = 512 * 2**20
    module, x = Transient(n), torch.zeros(1, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    cuda = torch.device("cuda")
    with DeviceMeter().measure("m", cuda, sample=True) as reading:
        module(x)
    # A new process peak: exact, the transient included.
    assert n <= reading.peak <= n + 2**20
    assert reading.margin == max(MARGIN_MIN, int(MARGIN_SHARE * reading.peak))
    with DeviceMeter().measure("m", cuda, sample=True) as reading:
        module(x)
    # Below the process peak now: sampled, and the transient inside one forward is missed.
    assert 0 <= reading.peak < 2**20 and reading.margin == MARGIN_MIN
