"""PEFT ``trainable_token_indices``: embedding rows (new or re-trained tokens) trained in full
beside the LoRA, saved as ``<module>.token_adapter.trainable_tokens_delta`` (the rows' values)
with their token ids in ``adapter_config.json``.

Files are written by PEFT itself on a transformers Llama (tiny config, tied and untied
embeddings) and merges compared with PEFT's ``merge_and_unload()``: the rows land bit for bit
at strength 1 and move on a straight line (``W + m * (value - W)``) at other strengths.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import shuttle
from shuttle.errors import AdapterFormatError, ShapeMismatchError, UnsupportedLayerError
from shuttle.formats.peft import PeftConfig
from tests import assert_bits_equal, close

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _llama(tied: bool, vocab: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied))


def _peft_file(tmp_path, base: torch.nn.Module, indices) -> torch.nn.Module:
    """PEFT's adapter (LoRA on q_proj, trained rows moved off their originals) saved to
    ``tmp_path``; returns PEFT's merge."""
    pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=2, init_lora_weights=False, target_modules=["q_proj"],
        trainable_token_indices=indices))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "trainable_tokens_delta" in name:
                p.add_(torch.randn(p.shape, generator=g))
    pm.save_pretrained(tmp_path)
    return pm.merge_and_unload()


CASES = {
    "list, tied": (True, [1, 5, 7]),
    "list, untied": (False, [1, 5, 7]),
    "dict, tied": (True, {"embed_tokens": [2, 3]}),
    "embedding and head, untied": (False, {"embed_tokens": [2, 3], "lm_head": [4, 9]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_merge_equals_peft(tmp_path, case):
    tied, indices = CASES[case]
    base = _llama(tied)
    want = _peft_file(tmp_path, base, indices)
    lora = shuttle.load_lora(tmp_path)
    assert "replace_rows" in {p.kind for ps in lora.modules.values() for p in ps}
    merged = copy.deepcopy(base)
    assert not shuttle.merge_lora(merged, [(lora, 1.0)], strict=True).unmatched
    got = merged.state_dict()
    for name, value in want.state_dict().items():
        if "q_proj" in name:  # the LoRA: float32 rounding (see test_peft_saved_whole.py)
            close(got[name], value, rtol=1e-6, atol=1e-6)
        else:  # the trained rows are PEFT's values, the other rows untouched
            assert_bits_equal(got[name], value, name)
    assert not torch.equal(got["model.embed_tokens.weight"],
                           base.state_dict()["model.embed_tokens.weight"])


def test_a_strength_moves_the_rows_alone_part_way(tmp_path):
    base = _llama(False)
    want = _peft_file(tmp_path, base, [1, 5, 7])
    merged = copy.deepcopy(base)
    shuttle.merge_lora(merged, [(tmp_path, 0.25)])
    before = base.model.embed_tokens.weight.detach()
    expected = before.clone()
    expected[[1, 5, 7]] = before[[1, 5, 7]].lerp(want.model.embed_tokens.weight[[1, 5, 7]], 0.25)
    assert_bits_equal(merged.model.embed_tokens.weight.detach(), expected)


def test_the_dynamic_forward_equals_peft(tmp_path):
    base = _llama(False)
    _peft_file(tmp_path, base, [1, 5, 7])
    ref = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    model = copy.deepcopy(base)
    shuttle.attach_lora(model, [(tmp_path, 1.0)])
    ids = torch.tensor([[1, 5, 7, 3, 0]])
    with torch.no_grad():
        close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_tied_rows_are_merged_never_half_dynamic(tmp_path):
    """On tied embeddings the rows are the head's too: a dynamic update in the embedding's
    forward would miss the head, so dynamic mode refuses (attaching nothing) and auto merges
    them whatever a merge rounds away."""
    base = _llama(True)
    _peft_file(tmp_path, base, [1, 5, 7])
    ref = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    model = copy.deepcopy(base)
    with pytest.raises(UnsupportedLayerError, match="tied to .*lm_head.weight"):
        shuttle.attach_lora(model, [(tmp_path, 1.0)])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    ids = torch.tensor([[1, 5, 7, 3, 0]])
    with torch.no_grad(), shuttle.apply_lora(model, [(tmp_path, 1.0)], mode="auto") as report:
        assert report.decisions["model.embed_tokens.weight"] == "merge"
        close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    # in bfloat16 the merge rounds the rows: merged all the same
    model = copy.deepcopy(base).to(torch.bfloat16)
    with shuttle.apply_lora(model, [(tmp_path, 1.0)], mode="auto",
                            auto_threshold=0.0) as report:
        assert report.losses["model.embed_tokens.weight"] > 0
        assert report.decisions["model.embed_tokens.weight"] == "merge"


def test_rows_without_their_config_name_the_fix(tmp_path):
    _peft_file(tmp_path, _llama(False), [1, 5, 7])
    with pytest.raises(AdapterFormatError, match="trainable_token_indices.*adapter_config.json"):
        shuttle.load_lora(tmp_path / "adapter_model.safetensors")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    lora = shuttle.load_lora(tmp_path / "adapter_model.safetensors", config=config)
    assert "replace_rows" in lora.kinds()


def test_a_config_that_disagrees_with_the_file_is_refused(tmp_path):
    _peft_file(tmp_path, _llama(False), [1, 5, 7])
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    config["trainable_token_indices"] = [1, 5]
    with pytest.raises(AdapterFormatError, match="2 token"):
        shuttle.load_lora(tmp_path / "adapter_model.safetensors", config=config)


@pytest.mark.parametrize("value", [[1, 1], [-1], [1.5], "1", {"emb": [True]}])
def test_malformed_token_ids_are_refused(value):
    with pytest.raises(AdapterFormatError, match="trainable_token_indices"):
        PeftConfig.from_dict({"trainable_token_indices": value})


def test_rows_beyond_the_models_vocabulary_change_nothing(tmp_path):
    """An adapter trained after resizing the vocabulary, loaded into the original model."""
    _peft_file(tmp_path, _llama(False, vocab=80), [70, 75])
    small = _llama(False)
    before = {n: p.detach().clone() for n, p in small.named_parameters()}
    with pytest.raises(ShapeMismatchError, match="resized vocabulary"):
        shuttle.merge_lora(small, [(tmp_path, 1.0)])
    assert all(torch.equal(before[n], p) for n, p in small.named_parameters())


def test_which_module_the_rows_belong_to():
    """A dict entry names the module or a dotted suffix of it (PEFT's ``_is_valid_match``); a
    list is the input embedding's, the one module PEFT saves rows for."""
    cfg = PeftConfig.from_dict({"trainable_token_indices": {"embed_tokens": [1], "head": [2]}})
    assert cfg.token_rows("base_model.model.model.embed_tokens") == (1,)
    assert cfg.token_rows("base_model.model.head") == (2,)
    assert cfg.token_rows("base_model.model.lm_head") is None  # "head" is no dotted suffix
    assert PeftConfig.from_dict({"trainable_token_indices": [4, 2]}).token_rows("x") == (4, 2)
