"""One strength check for every entry point (issue 19, item 15)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import shuttle
from shuttle.apply.strength import check_strength
from shuttle.errors import AdapterIndexError, InvalidStrengthError


@pytest.mark.parametrize("value", [0.5, 1, np.float32(0.5), np.float64(0.5), np.int64(1),
                                   torch.tensor(0.5), torch.tensor([0.5], dtype=torch.float16)])
def test_accepted(value):
    assert check_strength(value) == pytest.approx(float(value), rel=1e-3)


@pytest.mark.parametrize("value", [True, np.bool_(False), torch.tensor(True), "0.5", None,
                                   float("nan"), float("inf"), 1e308, -1e39,
                                   torch.tensor([0.5, 0.5]), complex(1, 0)])
def test_refused(value):
    with pytest.raises(InvalidStrengthError, match="loras\\[3\\] strength"):
        check_strength(value, "loras[3] strength")


def _handle():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6))
    sd = {"0.lora_A.weight": torch.randn(2, 8, generator=g),
          "0.lora_B.weight": torch.randn(6, 2, generator=g)}
    return model, sd, shuttle.attach_lora(model, [(sd, 1.0)])


def test_set_strength_takes_what_merge_takes():
    model, _, h = _handle()
    x = torch.randn(3, 8)
    h.set_strength(0, np.float32(0.25))
    y = model(x)
    h.set_strength(0, torch.tensor(0.25))  # refused before: a 0-dim tensor
    assert torch.equal(model(x), y)
    for bad in (True, 1e308):
        with pytest.raises(InvalidStrengthError, match=r"set_strength\(0, strength\)"):
            h.set_strength(0, bad)
    assert torch.equal(model(x), y)


def test_attach_refuses_a_strength_float32_cannot_hold():
    model, sd, h = _handle()
    h.detach()
    with pytest.raises(InvalidStrengthError, match="within float32's range"):
        shuttle.attach_lora(model, [(sd, 1e308)])


@pytest.mark.parametrize("index", [1, -2, "0", 0.0, True])
def test_an_index_that_names_no_adapter(index):
    model, sd, h = _handle()
    x = torch.randn(3, 8)
    y = model(x)
    why = ("no adapter of that name" if isinstance(index, str)
           else r"holds 1 adapter\(s\), at indices 0..0")
    with pytest.raises(AdapterIndexError, match=why):
        h.set_strength(index, 0.5)
    with pytest.raises(AdapterIndexError, match=r"swap\("):
        h.swap(index, sd)
    assert torch.equal(model(x), y)


def _sd(seed: int) -> dict[str, torch.Tensor]:
    """A low-rank adapter on ``0`` (a Linear: cached combined scales) and a LoHa on ``1`` (a
    weight residual)."""
    g = torch.Generator().manual_seed(seed)
    return {"0.lora_A.weight": torch.randn(2, 8, generator=g),
            "0.lora_B.weight": torch.randn(6, 2, generator=g),
            "lycoris_1.hada_w1_a": torch.randn(4, 2, generator=g) * 0.1,
            "lycoris_1.hada_w1_b": torch.randn(2, 6, generator=g) * 0.1,
            "lycoris_1.hada_w2_a": torch.randn(4, 2, generator=g) * 0.1,
            "lycoris_1.hada_w2_b": torch.randn(2, 6, generator=g) * 0.1}


def _two_models():
    """Two models, each with its own dynamic attachment of :func:`_sd`."""
    out = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
        out.append((model, shuttle.attach_lora(model, [(_sd(seed), 0.8)], quality="lossless")))
    return out


def test_set_strength_on_one_model_leaves_anothers_cached_scales_alone():
    (a, ha), (b, hb) = _two_models()
    x = torch.randn(3, 8)
    with torch.no_grad():
        a(x)
        want = b(x)
    hook = hb.hooks["0"]
    cached, generation = hook.scales._cached, hb.strengths.generation
    ha.set_strength(0, 0.3)
    ha.set_adapters({0: 0.5})
    assert hb.strengths.generation == generation
    with torch.no_grad():
        assert torch.equal(b(x), want)
    assert hook.scales._cached is cached  # not recomputed: b's strengths did not change
    hb.set_strength(0, 0.3)
    with torch.no_grad():
        b(x)
    assert hook.scales._cached is not cached
    ha.detach()
    hb.detach()


def test_set_strength_on_one_model_rewrites_only_its_own_followers():
    # What a CUDA graph captured reads (the layer's vector, shuttle.apply.scale.follow): a
    # strength change rewrites the vectors of its own attachment's layers only; the shared
    # request scale, process-wide, rewrites every attachment's.
    from shuttle.apply.scale import follow

    (a, ha), (b, hb) = _two_models()
    with torch.no_grad():
        a(torch.randn(3, 8))
        b(torch.randn(3, 8))
    rewritten = []
    for name, h in (("a", ha), ("b", hb)):
        scales = h.hooks["0"].scales
        follow(h.strengths, scales)
        refresh = scales.refresh_graph_scale
        scales.refresh_graph_scale = lambda name=name, refresh=refresh: (
            rewritten.append(name), refresh())
    ha.set_strength(0, 0.3)
    assert rewritten == ["a"]
    rewritten.clear()
    with shuttle.lora_scale(0.5):
        assert sorted(rewritten) == ["a", "b"]
    ha.detach()
    hb.detach()


def test_a_dynamic_attachment_holds_no_other_copy_of_its_strengths():
    # The hooks' weight-residual patches carry no strength of their own (the plan's, stale
    # after the first set_strength): the residual is computed from the handle's strengths.
    (model, h), _ = _two_models()
    x = torch.randn(3, 8)
    residual = h.hooks["1"]
    assert residual.dense and all(not hasattr(r, "strength")
                                  for rs in residual.dense.values() for r in rs)
    h.set_strength(0, 0.3)
    with torch.no_grad():
        got = model(x)
    h.detach()
    with torch.no_grad(), shuttle.apply_lora(model, [(_sd(1), 0.3)], mode="merge"):
        want = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
