"""Repeated merges: a remembered recipe replays the same launches, and only when the plan is the
same. On CPU the fused kernel runs through Triton's interpreter (as the merge tests route it)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import shuttle
from shuttle.apply.memo import clear_memo, memo_of
from tests import assert_bits_equal, snapshot
from tests.apply.test_merge import _stack, grid

RANK = 16  # a rank the kernel takes as it is (recipes keep no padded copies)


@pytest.fixture
def kernel(monkeypatch):
    """CPU merges through the interpreted fused kernel; yields counters of the host paths."""
    from shuttle.apply import fused_jobs, merge
    from shuttle.kernels import interpreting, triton_available

    if not (triton_available() and interpreting()):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set on CPU)")
    monkeypatch.setattr(fused_jobs, "on_kernel_device", lambda p: True)
    counts = {"prepared": 0, "replayed": 0}
    add, replay = merge.LowRankMerges.add, merge.replay_merges

    def counted_add(self, job):
        counts["prepared"] += 1
        return add(self, job)

    def counted_replay(launches):
        counts["replayed"] += 1
        return replay(launches)

    monkeypatch.setattr(merge.LowRankMerges, "add", counted_add)
    monkeypatch.setattr(merge, "replay_merges", counted_replay)
    return counts


def _model(n: int = 3, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    return _stack(n, dtype)


def _adapter(model: nn.Module, seed: int, rank: int = RANK) -> shuttle.LoRA:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i, layer in enumerate(model.layers):
        sd[f"layers.{i}.lora_A.weight"] = grid(rank, layer.in_features, g=g, k=2).float()
        sd[f"layers.{i}.lora_B.weight"] = grid(layer.out_features, rank, g=g, k=2).float()
    return shuttle.load_lora(sd)


def _merged_fresh(model: nn.Module, merges: list[tuple[shuttle.LoRA, float]]) -> nn.Module:
    """A copy of ``model`` after ``merges``, each prepared afresh (no recipe)."""

    twin = _model(len(model.layers), model.layers[0].weight.dtype)
    twin.load_state_dict(model.state_dict())
    for lora, strength in merges:
        clear_memo(twin)
        shuttle.merge_lora(twin, [(lora, strength)])
    return twin


def _assert_same(model: nn.Module, other: nn.Module) -> None:
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert_bits_equal(p.detach(), q.detach())


def test_a_repeated_merge_replays_the_same_launches(kernel):
    """The second merge of one adapter into one model replays the first one's launches (no
    job prepared again) and gives the bits of a merge prepared afresh."""
    model = _model()
    before = _model()
    lora = _adapter(model, 1)
    shuttle.merge_lora(model, [(lora, 0.5)])
    assert kernel == {"prepared": 3, "replayed": 0}
    shuttle.merge_lora(model, [(lora, 0.5)])
    assert kernel == {"prepared": 3, "replayed": 1}
    _assert_same(model, _merged_fresh(before, [(lora, 0.5), (lora, 0.5)]))


def test_scoped_merges_replay_and_restore(kernel):
    """apply_lora(mode="merge") per request: the merges after the first replay, and every
    exit restores the weights bit for bit."""
    model = _model()
    saved = snapshot(model)
    lora = _adapter(model, 2)
    x = torch.randn(2, model.layers[0].in_features).bfloat16()
    outs = []
    for _ in range(3):
        with shuttle.apply_lora(model, [(lora, 1.0)], mode="merge"):
            outs.append(model.layers[0](x))
        for n, p in model.named_parameters():
            assert_bits_equal(p.detach(), saved[n])
    assert kernel["replayed"] == 2
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("change", ["strength", "other adapter", "factor edited in place",
                                    "weight replaced", "dtype changed", "strides changed"])
def test_anything_changed_prepares_the_merge_afresh(kernel, change):
    """A recipe is used only for the same plan over the same tensors: any change is a miss,
    and the merge equals one prepared afresh."""
    model = _model()
    lora = _adapter(model, 3)
    shuttle.merge_lora(model, [(lora, 1.0)])
    reference = _model()
    reference.load_state_dict(model.state_dict())
    strength, second = 1.0, lora
    if change == "strength":
        strength = -0.5
    elif change == "other adapter":
        second = _adapter(model, 4)
    elif change == "factor edited in place":
        with torch.no_grad():
            dict(lora.patches())["layers.1"].up.mul_(2)
    elif change == "weight replaced":
        for m in (model, reference):
            m.layers[2].weight.data = m.layers[2].weight.detach().clone()
    elif change == "dtype changed":
        for m in (model, reference):
            m.to(torch.float16)
    elif change == "strides changed":  # the same values, column-major
        for m in (model, reference):
            w = m.layers[0].weight
            w.data = w.detach().t().contiguous().t()
    shuttle.merge_lora(model, [(second, strength)])
    assert kernel["replayed"] == 0
    _assert_same(model, _merged_fresh(reference, [(second, strength)]))


def test_merges_that_would_keep_copies_or_views_are_not_remembered(kernel):
    """No recipe where the kernel jobs use concatenated or padded factors (two adapters on one
    weight, a rank the kernel pads), or views of a weight (row ranges, reshaped weights):
    a recipe would keep those alive."""

    model = _model()
    for loras in ([(_adapter(model, 5), 1.0), (_adapter(model, 6), 1.0)],
                  [(_adapter(model, 7, rank=5), 1.0)]):
        shuttle.merge_lora(model, loras)
        shuttle.merge_lora(model, loras)
    assert kernel["replayed"] == 0 and not memo_of(model).recipes

    conv = nn.Sequential(nn.Conv2d(4, 8, 3, bias=False)).bfloat16()
    g = torch.Generator().manual_seed(8)
    sd = {"0.lora_A.weight": grid(RANK, 4, 3, 3, g=g).float(),
          "0.lora_B.weight": grid(8, RANK, 1, 1, g=g).float()}
    shuttle.merge_lora(conv, [(sd, 1.0)])
    assert not memo_of(conv).recipes


def test_recipes_die_with_their_adapter_and_are_bounded(kernel):
    """A recipe holds its adapter's tensors: it is dropped as soon as the adapter object is
    collected, and a model keeps at most MAX_RECIPES of them."""
    from shuttle.apply import recipe

    model = _model()
    lora = _adapter(model, 9)
    shuttle.merge_lora(model, [(lora, 1.0)])
    assert len(memo_of(model).recipes) == 1
    del lora
    gc.collect()
    assert memo_of(model).recipes == []
    loras = [_adapter(model, 10 + i) for i in range(recipe.MAX_RECIPES + 2)]
    for lora in loras:
        shuttle.merge_lora(model, [(lora, 1.0)])
    assert len(memo_of(model).recipes) == recipe.MAX_RECIPES
    shuttle.merge_lora(model, [(loras[-1], 1.0)])  # the most recent: still there
    assert kernel["replayed"] == 1


def test_a_replay_still_merges_the_weights_the_kernel_does_not_take(kernel):
    """A float64 weight beside the kernel's: the replay runs the recorded launches and merges
    the float64 weight as a fresh merge does."""
    model = _model()
    model.head = nn.Linear(20, 8, bias=False).double()
    before = snapshot(model)
    g = torch.Generator().manual_seed(12)
    lora = _adapter(model, 13)
    extra = {"head.lora_A.weight": grid(RANK, 20, g=g, k=2).float(),
             "head.lora_B.weight": grid(8, RANK, g=g, k=2).float()}
    lora = shuttle.load_lora({**{k: t for k, p in lora.patches()
                                 for k, t in ((f"{k}.lora_A.weight", p.down),
                                              (f"{k}.lora_B.weight", p.up))}, **extra})
    shuttle.merge_lora(model, [(lora, 1.0)])
    shuttle.merge_lora(model, [(lora, 1.0)])
    assert kernel == {"prepared": 3, "replayed": 1}
    want = before["head.weight"] + 2 * (extra["head.lora_B.weight"].double()
                                        @ extra["head.lora_A.weight"].double())
    assert_bits_equal(model.head.weight.detach(), want)
