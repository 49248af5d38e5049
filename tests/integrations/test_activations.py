"""The planner counts activations: a handle with a VRAM budget measures each call (here through
a meter that reports given numbers, since the CPU has no device memory statistics) and plans
each module's weights within the budget less its activations.

The tiny FluxPipeline runs on the CPU copy path; byte figures come from the storages' own
layouts, so the budgets below are exact, not guessed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from shuttle.errors import BudgetTooSmallError
from shuttle.integrations import diffusers as shuttle_diffusers
from shuttle.integrations.activations import DeviceMeter, meta_peak
from shuttle.offload import ModelOffloader
from tests.integrations.models import FakeMeter, active, offload, record, run_flux, sizes, snapshot

pytest.importorskip("diffusers")


@pytest.fixture(autouse=True)
def _cpu_copy(cpu_copy):
    """Every test here activates on the CPU through the copy path."""


@pytest.mark.parametrize(("reserve", "kept"), [(0, 5), (160_000, 1)])
def test_the_first_call_runs_at_the_floor_and_alone_then_the_reserve_shrinks_the_plan(
        plain, reserve, kept):
    ref, latents, _ = plain
    pipe = copy.deepcopy(ref)
    meter = FakeMeter({"transformer": reserve})
    off = shuttle_diffusers.offload(pipe, max_host_bytes=2**22, device="cpu")
    budget = sizes(off.offloaders["transformer"])[1]  # everything resident, no reserve
    off.remove()
    handle = offload(pipe, budget, meter)
    calls = record(pipe.transformer.transformer_blocks[0],
                   lambda: (handle.offloaders["transformer"].plan, active(handle)))
    assert torch.equal(run_flux(pipe), latents)
    plan, alone = calls[0]  # the first call at the floor: nothing resident, one slot a list,
    assert not any(plan.resident.values()) and set(plan.ring.values()) == {1}
    assert plan.prefetch == 0 and alone == {"transformer"}  # nothing else on the device
    assert handle.reserves["transformer"] == reserve and handle.reserves["vae"] is None
    assert [s for n, s in meter.calls if n == "transformer"] == [True, False]  # sampled once
    plan = calls[1][0]  # the second call: planned with the measured activations
    assert plan.device_bytes <= budget - reserve
    assert handle.offloaders["transformer"].plan == plan
    assert sum(map(len, plan.resident.values())) == kept  # the reserve took resident blocks
    decoding = record(pipe.vae.decoder, lambda: active(handle))
    assert active(handle) == {"transformer"}
    run_flux(pipe, "pt")
    assert decoding[-1] == {"vae"}  # the VAE's first decode, not measured yet: alone
    handle.remove()


def test_activations_over_what_the_floor_leaves_raise_naming_the_floor(plain):
    ref, latents, _ = plain
    pipe = copy.deepcopy(ref)
    before = snapshot(pipe.transformer)
    budget = 400_000
    floor = sizes(shuttle_diffusers.offload(copy.deepcopy(ref), max_host_bytes=2**22,
                                            device="cpu").offloaders["transformer"])[0]
    peak = budget - floor + 1
    handle = offload(pipe, budget, FakeMeter({"transformer": peak}, margin=10**6))
    with pytest.raises(BudgetTooSmallError) as e:
        run_flux(pipe)
    msg = str(e.value)
    assert f"floor of 'transformer', {floor + peak} bytes" in msg
    assert f"{floor} bytes of weights" in msg and f"{peak} bytes of activations" in msg
    handle.remove()
    from tests.integrations.models import assert_restored

    assert_restored(pipe.transformer, before)
    # At exactly the room the floor leaves, it runs: the margin is capped by that room.
    pipe = copy.deepcopy(ref)
    handle = offload(pipe, budget, FakeMeter({"transformer": peak - 1}, margin=10**6))
    assert torch.equal(run_flux(pipe), latents)
    plan = handle.offloaders["transformer"].plan
    assert not any(plan.resident.values()) and plan.prefetch == 0  # the floor
    handle.remove()


def test_a_call_that_outgrows_its_reserve_plans_again_and_only_then(plain, monkeypatch):
    ref, latents, _ = plain
    pipe = copy.deepcopy(ref)
    peaks = iter([100_000, 100_000, 110_000, 130_000])  # the reserve: 100_000 + 20_000
    meter = FakeMeter({"transformer": lambda: next(peaks)}, margin=20_000)
    plans = []
    plan_for = ModelOffloader.plan_for
    monkeypatch.setattr(ModelOffloader, "plan_for", lambda self, stream: plans.append(
        (self, stream and stream.activation_bytes)) or plan_for(self, stream))
    handle = offload(pipe, 600_000, meter)
    assert torch.equal(run_flux(pipe), latents)  # two calls: measured, then within the reserve
    assert torch.equal(run_flux(pipe), latents)  # 110_000: within; 130_000: planned again
    transformer = handle.offloaders["transformer"]
    assert [a for off, a in plans if off is transformer] == [0, 120_000, 150_000]
    handle.remove()


@pytest.mark.parametrize(("reserve", "beside"), [(0, True), (400_000, False)])
def test_others_stay_beside_the_running_module_as_far_as_their_weights_fit(
        plain, reserve, beside):
    ref, _, _ = plain
    budget = 10**6  # holds every module's weights, all resident: 673_472 bytes
    pipe = copy.deepcopy(ref)
    # CLIP's own reserve fits beside the transformer, not beside it and T5 as well: only its
    # weights count while T5 runs.
    meter = FakeMeter({"text_encoder": 350_000, "text_encoder_2": reserve})
    handle = offload(pipe, budget, meter)
    during = record(pipe.text_encoder_2.encoder.block[0], lambda: active(handle))
    for _ in range(3):
        run_flux(pipe)
    assert during[0] == {"text_encoder_2"}  # its first call, not measured yet: alone
    assert all("text_encoder" in d for d in during[1:])
    # The transformer stays beside it only when T5's reserve leaves the room, also in the
    # third pass, where T5 is still active when it is called.
    assert [("transformer" in d) for d in during[1:]] == [beside, beside]
    handle.remove()


@pytest.mark.parametrize(("room", "streams"), [(40_000, True), (600_000, False)])
def test_text_encoders_stream_when_the_budget_asks(plain, room, streams):
    ref, latents, _ = plain
    budget = 600_000
    pipe = copy.deepcopy(ref)
    handle = offload(pipe, budget, FakeMeter({"text_encoder_2": budget - room}))
    plans = record(pipe.text_encoder_2.encoder.block[1],
                   lambda: handle.offloaders["text_encoder_2"].plan)
    assert torch.equal(run_flux(pipe), latents)
    assert torch.equal(run_flux(pipe), latents)
    plan = plans[-1]  # the second call's, planned with its activations
    assert plan.device_bytes <= room
    assert (plan.ring == {"encoder.block": 1} and plan.resident == {"encoder.block": ()}
            if streams else plan.resident == {"encoder.block": (0, 1)})
    handle.remove()


@pytest.mark.parametrize(("untiled", "tiled"), [(600_000, True), (1000, False)])
def test_the_vae_decodes_tiled_only_when_its_activations_do_not_fit(plain, untiled, tiled):
    ref, _, pixels = plain
    budget = 600_000
    pipe = copy.deepcopy(ref)
    vae = pipe.vae
    seen = []
    meter = FakeMeter({"vae": lambda: seen.append(vae.use_tiling) or
                       (1000 if vae.use_tiling else untiled)})
    handle = offload(pipe, budget, meter)
    for _ in range(2):
        assert torch.equal(run_flux(pipe, "pt"), pixels)  # 16 px: one tile either way
    assert seen == [False, tiled]  # the first decode as the user set it, then tiled
    assert vae.use_tiling is tiled and vae.use_slicing is tiled
    handle.remove()
    assert vae.use_tiling is False and vae.use_slicing is False  # the user's settings back


def test_a_vae_too_large_even_tiled_raises(plain):
    ref, _, _ = plain
    budget = 600_000
    pipe = copy.deepcopy(ref)
    handle = offload(pipe, budget, FakeMeter({"vae": budget}))
    run_flux(pipe, "pt")
    with pytest.raises(BudgetTooSmallError, match="'vae'.*activations and of the caller's "
                                                  r"tensors beside them measured on its last "
                                                  r"call \(shrunk\)"):
        run_flux(pipe, "pt")  # still too large when tiled
    handle.remove()


@pytest.mark.parametrize(("side", "tiled"), [(256, True), (2, False)])
def test_a_first_decode_predicted_not_to_fit_runs_tiled_from_the_start(plain, side, tiled):
    ref, _, _ = plain
    pipe = copy.deepcopy(ref)
    vae = pipe.vae
    seen = record(vae.decoder, lambda: vae.use_tiling)
    handle = offload(pipe, 600_000, FakeMeter({"vae": 1000}))  # measured: it fits, tiled or not
    z = torch.randn(1, vae.config.latent_channels, side, side)
    vae.decode(z)  # (1, 4, 256, 256) float32 tensors, 1 MiB each, do not fit 600 kB
    assert seen[0] is tiled  # decided before the call, from a prediction
    handle.remove()


def test_a_prediction_counts_twice_its_bytes_and_the_margin_on_cuda_only():
    from shuttle.integrations import activations
    from shuttle.integrations.activations import predicted_reserve

    assert predicted_reserve(10**9, torch.device("cuda")) == 2 * 10**9 + 10**8
    assert predicted_reserve(1000, torch.device("cuda")) == 2000 + activations.MARGIN_MIN
    assert predicted_reserve(1000, torch.device("cpu")) == 1000  # nothing measured there


def test_meta_peak_counts_the_storages_alive_at_once():
    given = torch.empty(1000, device="meta")

    def fn():
        given.view(10, 100).add_(1)  # the caller's storage: a view and an in-place result
        a = torch.empty(1000, device="meta")  # 4000 bytes
        b = a * 2  # 8000 alive
        b.view(10, 100).add_(1)  # no new storage
        del a
        c = b + 1  # b and c: 8000
        return c.sum()

    assert meta_peak(fn) == 8000 + 4
    pair = [given, given]
    assert meta_peak(lambda: torch._foreach_add(pair, 1.0)) == 8000  # one list return, two new
    assert meta_peak(lambda: torch.split(given, 10)) == 0  # a list of views


def test_meta_peak_counts_attention_as_a_fused_kernel_allocates_it():
    q, k, v = (torch.empty(1, 2, 256, 8, device="meta", dtype=torch.bfloat16) for _ in range(3))
    # the math fallback would hold (1, 2, 256, 256) scores; fused kernels only the output
    assert meta_peak(lambda: F.scaled_dot_product_attention(q, k, v)) == 2 * 256 * 8 * 2


def test_a_vae_predicts_its_own_call_on_a_meta_twin():
    from diffusers import AutoencoderKL

    from shuttle.integrations.diffusers import _Tiling

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=2,
                        block_out_channels=(4, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=2)
    vae = vae.to(torch.bfloat16).eval()
    before = {n: p.clone() for n, p in vae.state_dict().items()}
    tiling = _Tiling(vae)
    z = torch.randn(1, 2, 16, 16, dtype=torch.bfloat16)
    with torch.no_grad():  # the same operators on real tensors: the same bytes
        assert tiling.predict("decode", (z,), {"return_dict": False}) == meta_peak(
            lambda: vae.decode(z, return_dict=False))
    larger = tiling.predict("decode", (torch.randn(1, 2, 32, 32, dtype=torch.bfloat16),), {})
    assert 3.9 < larger / tiling.predict("decode", (z,), {}) <= 4  # linear in the pixels
    assert all(torch.equal(p, before[n]) for n, p in vae.state_dict().items())
    assert all(p.device.type == "cpu" for p in vae.parameters())
    assert tiling.predict("no_such_method", (z,), {}) is None
    assert _Tiling(torch.nn.Conv2d(2, 3, 1)).predict("forward", (z,), {}) is None  # no config


def test_tiling_uses_tiles_of_512_pixels_and_restores_the_vae(plain):
    from diffusers import AutoencoderKL

    from shuttle.integrations.diffusers import _Tiling

    vae = AutoencoderKL(sample_size=1024, in_channels=3, out_channels=3, latent_channels=1,
                        block_out_channels=(4, 4), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=1)
    assert (vae.tile_sample_min_size, vae.tile_latent_min_size) == (1024, 512)
    tiling = _Tiling(vae)
    tiling.enable()
    assert (vae.use_tiling, vae.use_slicing) == (True, True)
    assert (vae.tile_sample_min_size, vae.tile_latent_min_size) == (512, 256)
    tiling.restore()
    assert (vae.use_tiling, vae.use_slicing) == (False, False)
    assert (vae.tile_sample_min_size, vae.tile_latent_min_size) == (1024, 512)


def test_the_device_meter_reads_nothing_off_cuda():
    with DeviceMeter().measure("x", torch.device("cpu"), True) as reading:
        torch.ones(1000)
    assert (reading.peak, reading.margin) == (0, 0)


def _fake_allocator(monkeypatch, current: int, peak: int) -> type[torch.nn.Module]:
    """The allocator's statistics faked (the CPU has none), and a module class whose
    ``Alloc(n)`` "allocates" ``n`` bytes (frees, when negative) as a CUDA call would."""
    from shuttle.integrations import activations

    state = {"current": current, "peak": peak}
    monkeypatch.setattr(activations, "_allocated", lambda device, which: state[which])

    class Alloc(torch.nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.n = n

        def forward(self, x):
            state["current"] += self.n
            state["peak"] = max(state["peak"], state["current"])
            return x

    Alloc.state = state
    return Alloc


def test_the_device_meter_is_exact_when_a_call_sets_the_peak_else_sampled(monkeypatch):
    from torch import nn

    from shuttle.integrations import activations

    Alloc = _fake_allocator(monkeypatch, current=1000, peak=5000)
    state = Alloc.state

    class Between(nn.Module):  # allocates outside any submodule, then frees in one
        def __init__(self):
            super().__init__()
            self.a, self.b = Alloc(100), Alloc(-800)

        def forward(self, x):
            x = self.a(x)
            state["current"] += 700  # a functional op: seen before b's forward only
            return self.b(x)

    hooks = (dict(torch.nn.modules.module._global_forward_hooks),
             dict(torch.nn.modules.module._global_forward_pre_hooks))
    cuda, meter = torch.device("cuda"), DeviceMeter()
    small = nn.Sequential(Alloc(300), Alloc(-200), Between(), Alloc(500), Alloc(-600))
    with meter.measure("m", cuda, sample=True) as reading:
        small(torch.ones(1))
    # Below the process peak: the largest sample (1900 allocated before b's forward, 1000 of
    # them there when the call started: weights).
    assert (reading.peak, reading.margin) == (900, activations.MARGIN_MIN)
    with meter.measure("m", cuda, sample=False) as reading:
        small(torch.ones(1))
    assert reading.peak == 0  # neither sampled nor a new peak: nothing learned
    big = nn.Sequential(Alloc(10**9), Alloc(-10**9))
    with meter.measure("m", cuda, sample=False) as reading:
        big(torch.ones(1))
    assert reading.peak == 10**9  # a new process peak: exact, without sampling
    assert reading.margin == int(activations.MARGIN_SHARE * 10**9)
    assert (dict(torch.nn.modules.module._global_forward_hooks),
            dict(torch.nn.modules.module._global_forward_pre_hooks)) == hooks  # removed


def test_the_device_meter_counts_only_what_the_call_allocates(monkeypatch):
    # Memory the caller holds on the device (a model of its own, 3 GB here) is not the call's
    # activations, whether the call sets the process peak or is sampled.
    from torch import nn

    held = 3 * 2**30
    Alloc = _fake_allocator(monkeypatch, current=1000 + held, peak=1000 + held)
    cuda, meter = torch.device("cuda"), DeviceMeter()
    with meter.measure("m", cuda, sample=False) as reading:  # a new process peak
        nn.Sequential(Alloc(5000), Alloc(-5000))(torch.ones(1))
    assert reading.peak == 5000
    with meter.measure("m", cuda, sample=True) as reading:  # below it: sampled
        nn.Sequential(Alloc(3000), Alloc(-3000))(torch.ones(1))
    assert reading.peak == 3000
