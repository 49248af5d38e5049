"""Tensors PEFT saves whole: ``modules_to_save`` copies and ``bias="all"`` biases.

PEFT writes them as plain ``base_model.model.<module>.<param>`` keys and names them only in
``adapter_config.json``. With the config shuttle applies them as whole-parameter replacements
(strength m: ``W + m * (value - W)``, PEFT's copy at m = 1); the files here are written by PEFT
itself (``get_peft_model`` + ``save_pretrained``) and compared with ``merge_and_unload()``.
Without the config they are refused with an error saying what they look like and how to load
them. The embedding rows of ``trainable_token_indices``: test_peft_trainable_tokens.py;
``target_parameters``: test_peft_target_parameters.py.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import UnknownKeyError
from shuttle.formats.peft import PeftConfig
from tests import assert_bits_equal, close

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)
        self.other = nn.Linear(5, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.other(self.head(self.lin(self.emb(ids))))


def _base() -> Base:
    torch.manual_seed(0)
    return Base()


def _peft_file(tmp_path, **config) -> tuple[nn.Module, nn.Module]:
    """Save a PEFT adapter (every trainable tensor randomized) of ``config`` to ``tmp_path``;
    return the base model and PEFT's own merge."""
    base = _base()
    pm = peft.get_peft_model(copy.deepcopy(base),
                             peft.LoraConfig(r=2, lora_alpha=4, target_modules=["lin"], **config))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in pm.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g))
    pm.save_pretrained(tmp_path)
    return base, pm.merge_and_unload()


IDS = torch.tensor([[1, 4, 9], [0, 2, 2]])
# A float32 LoRA merge agrees with PEFT's to float32 rounding, not bit for bit: PEFT rounds
# B @ A, then adds it to W; shuttle's CPU path is addmm_ into W, and whether the BLAS folds W
# into the product's accumulation (one rounding) depends on the CPU's kernel (on an AVX-512
# host MKL does, and the two differ by an ulp).
_LORA_MERGE = {"rtol": 1e-6, "atol": 1e-6}
CASES = {"modules_to_save": {"modules_to_save": ["head", "emb"]},
         "bias=all": {"bias": "all"},
         "bias=lora_only": {"modules_to_save": ["head"], "bias": "lora_only"},
         "both": {"modules_to_save": ["head", "emb"], "bias": "all"}}


@pytest.mark.parametrize("case", list(CASES))
def test_merge_equals_peft_merge_and_unload(tmp_path, case):
    base, want = _peft_file(tmp_path, **CASES[case])
    lora = shuttle.load_lora(tmp_path)
    merged = copy.deepcopy(base)
    report = shuttle.merge_lora(merged, [(lora, 1.0)])
    assert not report.unmatched
    assert all(".original_module." in k or ".modules_to_save." in k for k in lora.skipped)
    got = dict(merged.named_parameters())
    for name, p in want.named_parameters():
        if name == "lin.weight":  # the LoRA merge: float32 rounding, see _LORA_MERGE
            close(got[name], p, **_LORA_MERGE)
        else:  # the tensors saved whole land as PEFT's copies, bit for bit
            assert_bits_equal(got[name], p.detach(), name)
    changed = {n for n, p in base.named_parameters() if not torch.equal(p, got[n])}
    assert changed == set(report.applied)  # every saved tensor landed, nothing else moved


def test_the_keys_peft_writes_become_replacements(tmp_path):
    """bias="all" beside modules_to_save also saves the wrapper's own biases: the copy's
    again (``head.modules_to_save.bias``) and the discarded original's
    (``head.original_module.bias``); both are skipped with the reason."""
    _peft_file(tmp_path, modules_to_save=["head", "emb"], bias="all")
    lora = shuttle.load_lora(tmp_path)
    assert set(lora.skipped) == {"base_model.model.head.modules_to_save.bias",
                                 "base_model.model.head.original_module.bias"}
    kinds = {m: sorted((p.param, p.kind) for p in ps) for m, ps in lora.modules.items()}
    assert kinds == {
        "base_model.model.emb": [("weight", "replace")],
        "base_model.model.head": [("bias", "replace"), ("weight", "replace")],
        # bias="all": the LoRA layer's own bias is saved as lin.base_layer.bias
        "base_model.model.lin": [("bias", "replace"), ("weight", "lora")],
        "base_model.model.other": [("bias", "replace")],
    }


def test_strength_interpolates_towards_the_saved_copy(tmp_path):
    base, want = _peft_file(tmp_path, modules_to_save=["head", "emb"])
    merged = copy.deepcopy(base)
    shuttle.merge_lora(merged, [(shuttle.load_lora(tmp_path), 0.5)])
    for name in ("head.weight", "head.bias", "emb.weight"):
        w, v = dict(base.named_parameters())[name], dict(want.named_parameters())[name]
        torch.testing.assert_close(dict(merged.named_parameters())[name], w + 0.5 * (v - w))


def test_dynamic_equals_merge_and_restores(tmp_path):
    base, want = _peft_file(tmp_path, modules_to_save=["head", "emb"], bias="all")
    lora = shuttle.load_lora(tmp_path)
    model = copy.deepcopy(base)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with torch.no_grad():
        expected = want(IDS)
        with shuttle.apply_lora(model, [(lora, 1.0)], mode="dynamic") as handle:
            assert {"emb.weight", "head.weight", "head.bias"} <= set(handle.applied)
            got = model(IDS)
        # the LoRA on lin runs beside its weight (another rounding than the merged weight)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        with shuttle.apply_lora(model, [(lora, 1.0)], mode="merge"):
            close(model(IDS), want(IDS))  # the merged weight within an ulp, through 3 layers
    after = model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in before.items())  # scoped: exact restore


def test_a_bare_file_is_refused_with_what_the_keys_are(tmp_path):
    _peft_file(tmp_path, modules_to_save=["head", "emb"])
    file = tmp_path / "adapter_model.safetensors"
    with pytest.raises(UnknownKeyError, match="modules_to_save") as e:
        shuttle.load_lora(file)
    assert "adapter_config.json" in str(e.value) and "config=" in str(e.value)
    loose = shuttle.load_lora(file, strict=False)
    assert set(loose.skipped) == {"base_model.model.emb.weight", "base_model.model.head.weight",
                                  "base_model.model.head.bias"}
    assert all("modules_to_save" in why for why in loose.skipped.values())
    # the config passed by hand applies them, as loading the directory does
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert {p.kind for ps in shuttle.load_lora(file, config=config).modules.values()
            for p in ps} == {"lora", "replace"}


def test_which_keys_the_config_saves_whole():
    """PEFT's rules: a module is saved when its name, or a module's above it, ends with an
    entry (a plain string suffix: "head" takes "lm_head"); a LoRA layer's bias sits under its
    ``base_layer``; ``bias="all"`` also spells the wrapper's levels."""
    cfg = PeftConfig.from_dict({"modules_to_save": ["head", "classifier"], "bias": "all"})
    m = "base_model.model."
    assert cfg.saved_whole(m + "lm_head", "weight") == (m + "lm_head", None)
    assert cfg.saved_whole(m + "model.classifier.0", "weight") == (m + "model.classifier.0", None)
    assert cfg.saved_whole(m + "classifier.modules_to_save.0", "bias") == \
        (m + "classifier.0", "modules_to_save")
    assert cfg.saved_whole(m + "head.original_module", "bias") == (m + "head", "original_module")
    assert cfg.saved_whole(m + "layers.0.q.base_layer", "bias") == (m + "layers.0.q", None)
    assert cfg.saved_whole(m + "layers.0.q", "weight") is None
    plain = PeftConfig.from_dict({"modules_to_save": None, "bias": "none"})
    assert plain.saved_whole(m + "head", "bias") is None
