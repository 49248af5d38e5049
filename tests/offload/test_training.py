"""Training through streamed blocks: checkpointed backward, gradients, optimizer_step()."""

from __future__ import annotations

import copy

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
