"""PEFT adapters written by PEFT itself, run by shuttle, against PEFT's own forward.

For each algorithm PEFT offers (LoRA plain, rsLoRA, DoRA, ``lora_bias``, rank/alpha patterns;
LoHa with and without Tucker ``use_effective_conv2d``; LoKr with ``decompose_both`` True and
False, Tucker, ``decompose_factor``, patterns), ``peft.get_peft_model`` wraps every layer of
:class:`~tests.apply.oracle_models.Layers` that PEFT supports for it (LoRA: Linear, Conv1d,
Conv2d, Embedding; ``lora_bias``: not Embedding; LoHa/LoKr: Linear, Conv1d, Conv2d), the adapter
weights are set to random values and ``save_pretrained`` writes the directory. shuttle loads the
directory and runs it merged (``merge_lora``) and dynamic (``apply_lora(mode="dynamic")``).

Strength: PEFT's knob is the per-layer ``set_scale(adapter, k)`` (on ``LoraLayer`` and on
LoHa/LoKr's ``LycorisLayer``), which sets ``scaling = k * alpha / r`` (``k * alpha / sqrt(r)``
with rsLoRA, per-module alpha/r from the patterns). That is shuttle's strength ``k`` for every
algorithm here; for DoRA it scales the inner update before the norm (PEFT's rule). The oracle is
PEFT's unmerged forward at that scale; merged runs are also compared, parameter by parameter,
with PEFT's ``merge_and_unload()`` at that scale.
"""

from __future__ import annotations

import copy

import pytest
import torch

import shuttle
from tests.apply.oracle_models import (
    MODES,
    STRENGTHS,
    assert_outputs_close,
    make_base,
    outputs,
    randomize,
    shuttle_outputs,
)

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LORA_LAYERS = ["lin", "c1", "c2", "sq", "emb"]
NO_EMB = ["lin", "c1", "c2", "sq"]  # lora_bias, LoHa, LoKr: PEFT refuses nn.Embedding

# name -> (config factory, adapted layers)
CONFIGS = {
    "lora": (lambda t: peft.LoraConfig(r=4, lora_alpha=8, target_modules=t), LORA_LAYERS),
    "lora-rslora": (lambda t: peft.LoraConfig(r=4, lora_alpha=6, use_rslora=True,
                                              target_modules=t), LORA_LAYERS),
    "lora-patterns": (lambda t: peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=t, rank_pattern={"c1": 2, "emb": 3},
        alpha_pattern={"^lin": 5, "c2": 3, "emb": 1.5}), LORA_LAYERS),
    "dora": (lambda t: peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=t),
             LORA_LAYERS),
    "dora-rslora": (lambda t: peft.LoraConfig(r=2, lora_alpha=3, use_dora=True, use_rslora=True,
                                              target_modules=t), LORA_LAYERS),
    "lora-bias": (lambda t: peft.LoraConfig(r=4, lora_alpha=8, lora_bias=True,
                                            target_modules=t), NO_EMB),
    "loha": (lambda t: peft.LoHaConfig(r=4, alpha=8, target_modules=t), NO_EMB),
    "loha-tucker": (lambda t: peft.LoHaConfig(r=3, alpha=5, use_effective_conv2d=True,
                                              target_modules=t), NO_EMB),
    "loha-patterns": (lambda t: peft.LoHaConfig(r=2, alpha=8, rank_pattern={"lin": 3},
                                                alpha_pattern={"c2": 5}, target_modules=t),
                      NO_EMB),
    "lokr": (lambda t: peft.LoKrConfig(r=4, alpha=8, target_modules=t), NO_EMB),
    "lokr-decompose-both": (lambda t: peft.LoKrConfig(r=4, alpha=8, decompose_both=True,
                                                      target_modules=t), NO_EMB),
    "lokr-tucker": (lambda t: peft.LoKrConfig(r=2, alpha=3, use_effective_conv2d=True,
                                              target_modules=t), NO_EMB),
    "lokr-both-tucker": (lambda t: peft.LoKrConfig(r=2, alpha=3, decompose_both=True,
                                                   use_effective_conv2d=True,
                                                   target_modules=t), NO_EMB),
    "lokr-factor": (lambda t: peft.LoKrConfig(r=2, alpha=3, decompose_factor=4,
                                              target_modules=t), NO_EMB),
    "lokr-patterns": (lambda t: peft.LoKrConfig(r=2, alpha=8, rank_pattern={"c1": 1},
                                                alpha_pattern={"^lin": 2}, target_modules=t),
                      NO_EMB),
}


def peft_model(base, name: str, path):
    """PEFT's wrapper of ``CONFIGS[name]`` on a copy of ``base``, random weights, saved."""
    factory, layers = CONFIGS[name]
    pm = peft.get_peft_model(copy.deepcopy(base), factory(list(layers)))
    randomize((n, p) for n, p in pm.named_parameters() if p.requires_grad)
    pm.save_pretrained(str(path))
    return pm


def set_strength(pm, k: float) -> None:
    layers = [m for m in pm.modules() if isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer)]
    assert layers
    for m in layers:
        m.set_scale("default", k)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", STRENGTHS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_peft(name, k, mode, tmp_path):
    base = make_base()
    pm = peft_model(base, name, tmp_path)
    set_strength(pm, k)
    expected = outputs(pm.base_model.model)  # PEFT's forward at scale k

    lora = shuttle.load_lora(tmp_path)
    assert lora.format == "peft"
    got = shuttle_outputs(base, lora, k, mode)
    assert_outputs_close(got, expected, outputs(base), set(CONFIGS[name][1]))

    if mode == "merge":  # and PEFT's merge, parameter by parameter
        merged = pm.merge_and_unload()
        model = copy.deepcopy(base)
        shuttle.merge_lora(model, [(lora, k)])
        for n, p in model.named_parameters():
            e = merged.get_parameter(n)
            atol = 1e-6 * max(1.0, e.abs().max().item())
            torch.testing.assert_close(p, e, rtol=1e-5, atol=atol, msg=lambda m, n=n: f"{n}: {m}")
