"""Training through streamed blocks: checkpointed backward, gradients, optimizer_step()."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import shuttle
from shuttle.errors import CheckpointRequiredError, PendingGradientError, StreamModeError
from shuttle.offload import ModelOffloader, StreamConfig
from tests.offload.models import TinyDiT

PATHS = ["blocks", "single"]
TRAIN_MODES = {
    "whole": None,
    "stream0": StreamConfig(prefetch=0),
    "stream2": StreamConfig(prefetch=2),
    "resident": StreamConfig(prefetch=1, resident=2),
}



def checkpointed(model: TinyDiT, tokens: torch.Tensor) -> torch.Tensor:
    """TinyDiT's forward with every block under non-reentrant activation checkpointing."""
    x = model.embed(tokens)
    for b in [*model.blocks, *model.single]:
        x = checkpoint(b, x, use_reentrant=False)
    return model.head(model.norm(x))


def setup(freeze: bool):
    torch.manual_seed(0)
    model = TinyDiT()
    if freeze:  # train only the blocks' up projections and the final norm
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith(("up.weight", "up.bias")) or name.startswith("norm"))
    ref = copy.deepcopy(model)
    return ref, ModelOffloader.from_module(model, blocks=PATHS)


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, 9), generator=g), torch.randint(0, 64, (2, 9), generator=g)


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(checkpointed(model, x).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("freeze", [False, True])
@pytest.mark.parametrize("mode", list(TRAIN_MODES))
def test_gradients_and_optimizer_steps_match_the_resident_model(cpu_copy, mode, freeze):
    ref, off = setup(freeze)
    x, y = batch()
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt = torch.optim.AdamW([p for p in off.model.parameters() if p.requires_grad], lr=1e-2)
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    with off.use("cpu", TRAIN_MODES[mode]) as model:
        for _ in range(2):  # two steps: the second loads weights updated by the first
            loss_of(ref, x, y).backward()
            loss_of(model, x, y).backward()
            got = dict(model.named_parameters())
            for n, q in zip(names, [p for p in ref.parameters() if p.requires_grad],
                            strict=True):
                torch.testing.assert_close(got[n].grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
            opt_ref.step()
            opt_ref.zero_grad()
            with off.optimizer_step():
                opt.step()
                opt.zero_grad()
            with torch.no_grad():
                torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(off.model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)  # host copies updated


def test_the_recomputation_reloads_the_block(cpu_copy):
    ref, off = setup(freeze=False)
    x, y = batch()
    with off.use("cpu", StreamConfig(prefetch=1)) as model:
        s = off.streamers["blocks"]
        loss = loss_of(model, x, y)
        before = s.loads
        loss.backward()
        assert s.loads - before >= len(model.blocks) - 2  # blocks loaded again in backward
        assert all(p.grad is not None for p in model.blocks[0].parameters())


def test_a_backward_without_checkpointing_raises_instead_of_reading_a_refilled_slot(cpu_copy):
    _, off = setup(freeze=False)
    x, _ = batch()
    with off.use("cpu", StreamConfig(prefetch=0)) as model:
        out = model(x)  # the forward itself is unchanged
        with pytest.raises(CheckpointRequiredError, match="checkpoint"):
            out.sum().backward()


def test_gradients_left_after_the_step_raise_and_the_activation_stays_usable(cpu_copy):
    ref, off = setup(freeze=True)
    x, y = batch()
    opt = torch.optim.SGD([p for p in off.model.parameters() if p.requires_grad], lr=0.1)
    with off.use("cpu", StreamConfig(prefetch=1)) as model:
        loss_of(model, x, y).backward()
        with pytest.raises(PendingGradientError, match="zero_grad"), off.optimizer_step():
            opt.step()
        opt.zero_grad()
        with torch.no_grad():
            assert not torch.equal(model(x), ref(x))  # the step landed
        loss_of(model, x, y).backward()


def test_training_a_weight_folded_by_a_merge_mode_adapter_raises(cpu_copy):
    _, off = setup(freeze=True)
    lora = shuttle.load_lora({"blocks.0.up.diff": torch.full((128, 32), 0.01)})
    with (off.use("cpu", StreamConfig(prefetch=1), loras=[(lora, 1.0)]),
          pytest.raises(StreamModeError, match="mode='dynamic'"), off.optimizer_step()):
        pass


def test_optimizer_step_when_inactive_is_a_plain_step():
    ref, off = setup(freeze=True)
    x, y = batch()
    opt = torch.optim.SGD([p for p in off.model.parameters() if p.requires_grad], lr=0.1)
    loss_of(off.model, x, y).backward()
    with off.optimizer_step():
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        assert not torch.equal(off.model(x), ref(x))


@pytest.mark.gpu
def test_checkpointed_training_on_cuda_matches_the_resident_model():
    ref, off = setup(freeze=True)
    ref = ref.cuda()
    x, y = (t.cuda() for t in batch())
    loss_of(ref, x, y).backward()
    with off.use("cuda", StreamConfig(prefetch=1)) as model:
        loss_of(model, x, y).backward()
        got = dict(model.named_parameters())
        for n, q in ref.named_parameters():
            if q.requires_grad:
                torch.testing.assert_close(got[n].grad, q.grad, msg=n)


def _lora_dit(accelerated: bool):
    """TinyDiT with PEFT LoRA on every block's linears (frozen base), optionally under
    shuttle.train.accelerate."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = TinyDiT()
    model.requires_grad_(False)
    model = peft.inject_adapter_in_model(
        peft.LoraConfig(r=4, target_modules=["attn", "up", "down"], init_lora_weights=False),
        model)
    if accelerated:
        import shuttle.train

        shuttle.train.accelerate(model)
    return model


def train_alike(ref, off, config, check=None):
    """Two AdamW steps of ``ref`` (resident) and of ``off``'s model (``trainable="device"``)
    under ``config``: every adapter gradient equal at each step; ``check(parameters)`` true."""
    x, y = batch()
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt = torch.optim.AdamW(off.on_device, lr=1e-2)
    with off.use("cpu", config) as active:
        for _ in range(2):
            loss_of(ref, x, y).backward()
            loss_of(active, x, y).backward()
            got = dict(active.named_parameters())
            for n, q in ref.named_parameters():
                if q.requires_grad:
                    torch.testing.assert_close(got[n].grad, q.grad, rtol=1e-5, atol=1e-6,
                                               msg=n)
            assert check is None or check(got)
            opt_ref.step()
            opt_ref.zero_grad()
            opt.step()  # on the device, as for any model: no optimizer_step() needed
            opt.zero_grad()


@pytest.mark.parametrize("mode", ["stream0", "stream2", "resident", "budget"])
@pytest.mark.parametrize("accelerated", [False, True])
def test_lora_factors_stay_on_the_device_while_the_frozen_blocks_stream(cpu_copy, mode,
                                                                          accelerated):
    from tests.offload.models import RESIDENCY_MODES

    ref = _lora_dit(accelerated)
    model = copy.deepcopy(ref)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    off = ModelOffloader.from_module(model, blocks=PATHS, trainable="device")
    assert {id(p) for p in off.on_device} == {id(p) for n, p in model.named_parameters()
                                              if n in trainable}
    frozen_bytes = sum(p.numel() * p.element_size() for p in ref.parameters()) + sum(
        b.numel() * b.element_size() for b in ref.buffers())
    assert off.storage.weight_bytes < frozen_bytes  # the factors are not in host storage
    train_alike(ref, off, RESIDENCY_MODES[mode])
    got = dict(off.model.named_parameters())
    for n, q in ref.named_parameters():
        torch.testing.assert_close(got[n], q, rtol=1e-5, atol=1e-6, msg=n)


def _quantized_lora_dit(kind: str, accelerated: bool):
    """_lora_dit with the blocks' frozen bases stored quantized: ``"float8"`` (e4m3, upcast on
    use) or ``"nf4"`` (bitsandbytes ``Linear4bit``)."""
    if kind == "nf4":
        from tests.offload.test_quantized_offload import quantized_linear

        peft = pytest.importorskip("peft")
        torch.manual_seed(0)
        model = TinyDiT()
        for b in [*model.blocks, *model.single]:
            for name in ("attn", "up", "down"):
                setattr(b, name, quantized_linear("nf4", getattr(b, name)))
        model.requires_grad_(False)
        model = peft.inject_adapter_in_model(
            peft.LoraConfig(r=4, target_modules=["attn", "up", "down"],
                            init_lora_weights=False), model)
    else:
        model = _lora_dit(False)
        for name, p in model.named_parameters():
            if name.endswith("base_layer.weight"):
                p.data = p.data.to(torch.float8_e4m3fn)
        shuttle.upcast_on_use(model, torch.float32)
    if accelerated:
        from shuttle.train import accelerate

        report = accelerate(model)
        assert report.patched  # the quantized bases take the fast path, not PEFT's fallback
    return model


@pytest.mark.parametrize("accelerated", [False, True])
@pytest.mark.parametrize("kind", ["float8", "nf4"])
def test_lora_training_over_quantized_blocks_streams_them_in_their_stored_form(
        cpu_copy, kind, accelerated):
    ref = _quantized_lora_dit(kind, accelerated)
    model = copy.deepcopy(ref)
    stored = {n: p.dtype for n, p in model.named_parameters() if n.endswith("base_layer.weight")}
    off = ModelOffloader.from_module(model, blocks=PATHS, trainable="device")
    moved = {d for us in off.storage.groups.values() for u in us for d in u.layout.dtypes}
    assert set(stored.values()) <= moved  # float8 / packed uint8 move as they are stored
    train_alike(ref, off, StreamConfig(prefetch=1),
                check=lambda got: {n: got[n].dtype for n in stored} == stored)


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_a_training_step_copies_no_block_it_does_not_use(cpu_copy, prefetch):
    # Forward 0..n-1, then the backward n-1..0, then the next forward from 0: at each turn the
    # ring already holds the blocks called next, so a step loads each streamed block once each
    # way except the ring's d + 1 at the two turns (a cyclic prefetch at the turns loads d
    # blocks the step does not call next, four times a step).
    off = ModelOffloader.from_module(_lora_dit(False), blocks=PATHS, trainable="device")
    x, y = batch()
    with off.use("cpu", StreamConfig(prefetch=prefetch)) as model:
        for step in range(3):
            before = {p: s.loads for p, s in off.streamers.items()}
            loss_of(model, x, y).backward()
            model.zero_grad()
            if step:  # the first step starts from the warm-up loads
                for p, s in off.streamers.items():
                    n = len(getattr(model, p))  # 5 and 3 blocks: a ring of up to all of them
                    assert s.loads - before[p] == 2 * max(0, n - prefetch - 1), p
        with torch.no_grad():  # inference: each block once a step, the last ones prefetching
            model(x)  # the next step's first ones
            before = {p: s.loads for p, s in off.streamers.items()}
            model(x)
            for p, s in off.streamers.items():
                n = len(getattr(model, p))
                assert s.loads - before[p] == (n if n > prefetch + 1 else 0), p
                assert s.slot_of(0) is not None, p


def test_trainable_on_device_counts_against_the_budget(cpu_copy):
    from shuttle.errors import BudgetTooSmallError

    off = ModelOffloader.from_module(_lora_dit(False), blocks=PATHS, trainable="device")
    kept = sum(p.numel() * p.element_size() for p in off.on_device)
    with pytest.raises(BudgetTooSmallError, match="trainable"):
        off.activate("cpu", StreamConfig(vram_budget=kept))
    assert not off.active
    plain = ModelOffloader.from_module(_lora_dit(False), blocks=PATHS)
    budget = 150_000
    with plain.use("cpu", StreamConfig(vram_budget=budget)):
        resident_plain = plain.plan.device_bytes
    with off.use("cpu", StreamConfig(vram_budget=budget)):
        assert off.plan.device_bytes + kept <= budget
        assert off.plan.device_bytes <= resident_plain


def test_unknown_trainable_placement_is_refused():
    from shuttle.errors import OffloadError

    with pytest.raises(OffloadError, match="trainable='gpu'"):
        ModelOffloader.from_module(TinyDiT(), blocks=PATHS, trainable="gpu")


# torch's stream sanitizer loses a pending exception when a custom autograd.Function is the last
# op saving tensors in a non-reentrant checkpoint's recomputation (a pure-torch Function, no
# shuttle code, fails the same way): strict, so the marker goes once torch fixes it.
_CSAN_CHECKPOINT_BUG = pytest.mark.xfail(
    os.environ.get("TORCH_CUDA_SANITIZER") == "1", raises=SystemError, strict=True,
    reason="torch CUDA sanitizer + checkpoint recomputation of a custom autograd.Function")


@pytest.mark.gpu
@_CSAN_CHECKPOINT_BUG
def test_gpu_lora_training_with_resident_factors_matches_the_resident_model():
    ref = _lora_dit(True).cuda()
    model = copy.deepcopy(ref).cpu()
    off = ModelOffloader.from_module(model, blocks=PATHS, trainable="device")
    x, y = (t.cuda() for t in batch())
    loss_of(ref, x, y).backward()
    with off.use("cuda", StreamConfig(prefetch=1)) as active:
        assert all(p.is_cuda for p in off.on_device)
        loss_of(active, x, y).backward()
        got = dict(active.named_parameters())
        for n, q in ref.named_parameters():
            if q.requires_grad:
                torch.testing.assert_close(got[n].grad, q.grad, msg=n)
    assert not any(p.is_cuda for p in off.on_device)
