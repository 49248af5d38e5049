"""PEFT ``rank_pattern``/``alpha_pattern`` keys: matched as PEFT matches them, never in
unbounded time (the patterns come from the file)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from peft.utils.other import get_pattern_key
from safetensors.torch import save_file

from shuttle import load_lora
from shuttle.errors import AdapterFormatError
from shuttle.formats.peft import PeftConfig

NAMES = [
    "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
    "mid_block.attentions.0.transformer_blocks.0.attn2.to_k",
    "transformer_blocks.1.attn.to_v", "single_transformer_blocks.1.attn.to_v",
    "model.layers.10.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "lin", "lin2",
    "emb", "c1", "block.c1", "blockc1", "a.b.c",
]
PATTERNS = [
    "to_q", "attn1.to_q", "q_proj", "layers.1.self_attn.q_proj", "c1", "lin", "emb",  # plain
    "^lin", "^transformer_blocks.1.attn.to_v", "^down_blocks.0.attentions.0.transformer_blocks"
    ".0.attn1.to_q", "^model.layers.1.self_attn.q_proj",  # diffusers' anchored names
    "down_blocks.*to_q", "layers.1.*q_proj", ".*attn2.*", "model.layers.1.*",
    "to_q|to_k", "c.", "a\\.b.c",  # simple wildcards, alternatives, escapes
]


@pytest.mark.parametrize("pat", PATTERNS)
def test_matches_like_peft(pat):
    cfg = PeftConfig(rank_pattern={pat: 3})
    for name in NAMES:
        want = get_pattern_key([pat], name) == pat
        assert (cfg.rank_for(f"base_model.model.{name}") == 3) == want, (pat, name)


def test_a_catastrophic_pattern_is_refused_at_load_quickly(tmp_path):
    """``(a|aa)+b`` against a 44-character name took 83 s in ``re``."""
    f = tmp_path / "evil.safetensors"
    name = "a" * 44
    save_file({f"{name}.lora_A.weight": torch.randn(2, 6),
               f"{name}.lora_B.weight": torch.randn(8, 2)}, str(f),
              metadata={"lora_adapter_metadata": json.dumps(
                  {"r": 2, "lora_alpha": 2, "alpha_pattern": {"(a|aa)+b": 1.0}})})
    start = time.perf_counter()
    with pytest.raises(AdapterFormatError, match=r"'\(a\|aa\)\+b'.*rewrite the key"):
        load_lora(f)
    assert time.perf_counter() - start < 1.0


def test_wildcards_on_long_names_take_linear_time():
    cfg = PeftConfig(alpha_pattern={"a*a*a*a*a*a*a*a*a*b": 2.0, ".*.*.*.*.*.*.*x": 3.0})
    start = time.perf_counter()
    assert cfg.alpha_for("a" * 2000) == cfg.alpha
    assert time.perf_counter() - start < 1.0
