"""CUDA merges (the fused kernel path) agree with the CPU float32 path and float64 math."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shuttle
from shuttle.apply.memo import clear_memo

pytestmark = pytest.mark.gpu


def _model():
    torch.manual_seed(0)
    m = nn.Module()
    m.attn = nn.Module()
    m.attn.to_qkv = nn.Linear(96, 288)
    m.ff = nn.Linear(96, 200)
    return m.to(torch.bfloat16)


def _adapter(seed):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, out in (("attn.to_q", 96), ("attn.to_k", 96), ("attn.to_v", 96), ("ff", 200)):
        sd[f"{name}.lora_A.weight"] = (torch.randn(8, 96, generator=g) * 0.1).bfloat16()
        sd[f"{name}.lora_B.weight"] = (torch.randn(out, 8, generator=g) * 0.1).bfloat16()
        sd[f"{name}.alpha"] = torch.tensor(4.0)
    return sd


def test_cuda_merge_matches_cpu_merge():
    cpu, gpu = _model(), _model().cuda()
    loras = [(_adapter(1), 0.8), (_adapter(2), -0.3)]
    shuttle.merge_lora(cpu, loras)
    shuttle.merge_lora(gpu, [({k: v.cuda() for k, v in sd.items()}, m) for sd, m in loras])
    for (name, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters(), strict=True):
        b = b.detach().cpu()
        ulp = (torch.nextafter(a, torch.full_like(a, torch.inf)).double() - a.double()).abs()
        assert bool(((a.double() - b.double()).abs() <= ulp).all()), name
        assert int((a != b).sum()) <= max(1, a.numel() // 1000), name


def test_cuda_scoped_merge_restores_bit_for_bit():
    gpu = _model().cuda()
    before = {n: p.detach().clone() for n, p in gpu.named_parameters()}
    sd = {k: v.cuda() for k, v in _adapter(3).items()}
    with shuttle.apply_lora(gpu, [(sd, 1.0)]):
        assert not torch.equal(gpu.ff.weight, before["ff.weight"])
    assert all(torch.equal(p, before[n]) for n, p in gpu.named_parameters())


def test_cuda_float16_overflow_raises_and_scoped_merge_restores():
    """The fused kernel flags a float16 overflow; merge_lora raises naming the weight, as the
    CPU path does (after the merge: the flags are read once at the end)."""
    gpu = _model().half().cuda()
    before = {n: p.detach().clone() for n, p in gpu.named_parameters()}
    sd = {k: v.cuda() for k, v in _adapter(4).items()}
    # every element of ff's update: 8 ranks x 200 x 200 x alpha / rank (0.5) = 160000 > 65504
    sd["ff.lora_A.weight"] = torch.full_like(sd["ff.lora_A.weight"], 200.0)
    sd["ff.lora_B.weight"] = torch.full_like(sd["ff.lora_B.weight"], 200.0)
    with pytest.raises(shuttle.errors.NonFiniteAdapterError), \
            shuttle.apply_lora(gpu, [(sd, 1.0)]):
        pytest.fail("the body must not run")
    assert all(torch.equal(p, before[n]) for n, p in gpu.named_parameters())
    with pytest.raises(shuttle.errors.NonFiniteAdapterError, match="'ff.weight'"):
        shuttle.merge_lora(gpu, [(sd, 1.0)])


def test_repeated_cuda_merges_replay_and_equal_fresh_merges():
    """Merging one adapter again replays the remembered launches (apply.recipe): the weights
    equal those of merges prepared afresh, bit for bit, on grouped launches of several
    same-shaped weights."""
    from shuttle.apply import merge

    def stack():
        torch.manual_seed(3)
        return nn.Sequential(*[nn.Linear(64, 96, bias=False) for _ in range(5)]).cuda().bfloat16()

    g = torch.Generator().manual_seed(4)
    sd = {}
    for i in range(5):
        sd[f"{i}.lora_A.weight"] = (torch.randn(16, 64, generator=g) * 0.1).bfloat16().cuda()
        sd[f"{i}.lora_B.weight"] = (torch.randn(96, 16, generator=g) * 0.1).bfloat16().cuda()
    lora = shuttle.load_lora(sd)
    model, fresh = stack(), stack()
    replays = []
    real = merge.replay_merges
    merge.replay_merges = lambda launches: replays.append(len(launches)) or real(launches)
    try:
        for _ in range(3):
            shuttle.merge_lora(model, [(lora, 0.7)])
            shuttle.merge_lora(fresh, [(lora, 0.7)])
            clear_memo(fresh)
    finally:
        merge.replay_merges = real
    assert len(replays) == 2
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
