"""PEFT ``rank_pattern``/``alpha_pattern`` keys: matched as PEFT matches them (real regexes such as
``layers\\.\\d+\\.self_attn\\.q_proj`` and ``(q|k)_proj`` included), never in unbounded time (the
keys come from the file)."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import re
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft.utils.other import get_pattern_key
from safetensors.torch import save_file
from torch import nn

from shuttle import load_lora
from shuttle.errors import AdapterFormatError
from shuttle.formats.peft import PeftConfig
from shuttle.formats.peft_patterns import MAX_KEY_CHARS, compile_key

NAMES = [
    "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
    "mid_block.attentions.0.transformer_blocks.0.attn2.to_k",
    "transformer_blocks.1.attn.to_v", "single_transformer_blocks.1.attn.to_v",
    "model.layers.10.self_attn.q_proj", "model.layers.1.self_attn.q_proj",
    "model.layers.1.self_attn.k_proj", "model.layers.1.mlp.up_proj", "q_proj", "lin", "lin2",
    "emb", "c1", "block.c1", "blockc1", "a.b.c", "", "x.", "a{", "]", "lin\n", "x\n.lin",
]
PATTERNS = [
    "to_q", "attn1.to_q", "q_proj", "layers.1.self_attn.q_proj", "c1", "lin", "emb",  # plain
    "^lin", "^transformer_blocks.1.attn.to_v", "^down_blocks.0.attentions.0.transformer_blocks"
    ".0.attn1.to_q", "^model.layers.1.self_attn.q_proj",  # diffusers' anchored names
    "down_blocks.*to_q", "layers.1.*q_proj", ".*attn2.*", "model.layers.1.*",
    "to_q|to_k", "c.", "a\\.b.c",  # simple wildcards, alternatives, escapes
    # what PEFT users write: classes, groups, counted repeats, anchors
    r"layers\.\d+\.self_attn\.q_proj", r"(q|k)_proj", r"[qk]_proj", r"to_[qkv]",
    r"layers\.\d{2}\.self_attn\..*", r"layers\.\d{1,2}\.self_attn\.(?:q|k)_proj",
    r"(?P<which>to_q)", r"\w+\.to_v", r"\bto_q", r"blocks?\.1\.", r"lin$", r"lin\Z",
    r"\Amodel\..*", r"[^.]+_proj", r"(q|k)_proj|lin", r"c(?#comment)1", r"\x63\d",
    # what re reads unlike it looks: a "{" that repeats nothing, a key closing PEFT's group
    r"a{", r"a{1,x}", r"[]]", r"lin)|(emb",
    # what backtracks catastrophically in re, fine on these short names
    r"(a|aa)+b", r"(a*)*b",
]


@pytest.mark.parametrize("pat", PATTERNS)
def test_matches_like_peft(pat):
    cfg = PeftConfig(rank_pattern={pat: 3})
    for name in NAMES:
        want = get_pattern_key([pat], name) == pat and bool(re.match(rf"(.*\.)?({pat})$", name))
        assert (cfg.rank_for(f"base_model.model.{name}") == 3) == want, (pat, name)


_TOKENS = ["a", "b", "1", ".", r"\.", "(", ")", "(?:", "|", "*", "+", "?", "*?", "{2}", "{1,2}",
           "{,1}", "{", "}", "[ab]", "[^a]", r"\d", r"\w", "^", "$", r"\b", r"\B", r"\A", r"\Z"]
_NAMES = ["", "a", "b", "ab", "a.b", "a.a.b", "aab", "1", "a1.b", "ba.", ".a", "a.b.ab", "{",
          "a\n", "a\n.b"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_TOKENS), min_size=1, max_size=8).map("".join))
def test_random_patterns_match_like_re(key):
    full = rf"(.*\.)?({key})$"
    try:
        pattern = re.compile(full)
    except re.error:
        return
    try:
        compiled = compile_key(key)
    except AdapterFormatError as e:  # the one construct of these tokens refused: a*+, a{2}+
        assert "possessive quantifier" in str(e), key
        return
    for name in _NAMES:
        assert compiled.matches(name) == bool(pattern.match(name)), (key, name)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_TOKENS), min_size=1, max_size=8).map("".join))
def test_whole_name_patterns_match_like_fullmatch(key):
    """A ``target_modules`` string: PEFT runs ``re.fullmatch(key, name)``."""
    try:
        re.compile(key)
    except re.error:
        return
    try:
        compiled = compile_key(key, whole=True)
    except AdapterFormatError as e:
        assert "possessive quantifier" in str(e), key
        return
    for name in _NAMES:
        assert compiled.matches(name) == bool(re.fullmatch(key, name)), (key, name)


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(4, 4) for _ in range(3))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attn()
        self.mlp = nn.Module()
        self.mlp.up_proj = nn.Linear(4, 6)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Layer() for _ in range(12))


@pytest.mark.parametrize("targets", [
    ["q_proj", "k_proj", "v_proj", "up_proj"],
    # a string: PEFT's re.fullmatch on the full module name; the file's keys then name them
    r"model\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.up_proj)",
])
def test_a_peft_adapter_with_regex_patterns_gets_peft_ranks_and_scales(tmp_path, targets):
    """PEFT saves an adapter with these keys and loads it back; shuttle gives every layer the
    rank and scale PEFT's load gives it (``layer.r``, ``layer.scaling``), so it picked the same
    key for each. Where several keys match, the first in the saved file wins (PEFT writes the
    config with its keys sorted, so its load may pick another one than its training did).
    """
    import peft

    torch.manual_seed(0)
    cfg = peft.LoraConfig(
        r=2, lora_alpha=2, init_lora_weights=False,
        target_modules=targets,
        rank_pattern={r"layers\.\d+\.self_attn\.q_proj": 4, r"layers\.1[01]\.mlp\..*": 3},
        alpha_pattern={r"(q|k)_proj": 5.0, r"layers\.(1|10)\..*_proj": 7.0,
                       r"\d\.self_attn\.v_proj": 9.0})
    peft.get_peft_model(TinyLM(), cfg).save_pretrained(tmp_path / "ad")
    model = peft.PeftModel.from_pretrained(TinyLM(), tmp_path / "ad")
    lora = load_lora(tmp_path / "ad")
    adapted = {name: layer for name, layer in model.named_modules()
               if isinstance(layer, peft.tuners.lora.LoraLayer)}
    assert len(adapted) == 48 and set(lora.modules) == set(adapted)
    for name, layer in adapted.items():
        (patch,) = lora.modules[name]
        assert (patch.rank, patch.scale) == (layer.r["default"], layer.scaling["default"]), name
    assert {p.rank for _, p in lora.patches()} == {2, 3, 4}
    assert {p.scale for _, p in lora.patches()} >= {5 / 2, 5 / 4, 7 / 2, 9 / 2, 1.0}


@contextlib.contextmanager
def _hang_guard(capfd, seconds: int = 300):
    """A backtracking matcher would not finish the cases below in any lifetime: end the run,
    printing where it hung (stderr uncaptured), rather than hang. No timing is asserted.
    """
    with capfd.disabled():
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


# (key, name, whether PEFT's re.match would match): each takes re about 2**len(name) steps or
# a high power of len(name), on names of thousands of characters
HOSTILE = [
    (r"(a+)+$", "a" * 3000 + "!", False),
    (r"(a|aa)+b", "a" * 3000, False),
    (r"(a*)*b", "a" * 3000, False),
    (r"(x+x+)+y", "x" * 3000, False),
    (r"(.*a){20}", "a" * 3000 + "!", False),
    (r"a*a*a*a*a*a*a*a*a*b", "a" * 3000, False),
    (r".*.*.*.*.*.*.*x", "a" * 3000, False),
    (r"(\w+\d*)+!x", "a1" * 1500 + "!", False),
    (r"(a|aa)+", "a" * 3000, True),
]


def test_hostile_keys_are_matched_without_backtracking(capfd):
    with _hang_guard(capfd):
        for key, name, want in HOSTILE:
            assert compile_key(key).matches(name) is want, key


def test_a_hostile_key_in_a_file_loads(tmp_path, capfd):
    """``(a|aa)+b`` against a 44-character name took 83 s in ``re``; it is PEFT syntax, so it
    is accepted, and matches nothing here (the module keeps the default alpha)."""
    f = tmp_path / "evil.safetensors"
    name = "a" * 44
    save_file({f"{name}.lora_A.weight": torch.randn(2, 6),
               f"{name}.lora_B.weight": torch.randn(8, 2)}, str(f),
              metadata={"lora_adapter_metadata": json.dumps(
                  {"r": 2, "lora_alpha": 2, "alpha_pattern": {"(a|aa)+b": 1.0, "(a|aa)+": 3.0}})})
    with _hang_guard(capfd):
        lora = load_lora(f)
    assert lora.modules[name][0].scale == 3.0 / 2


@pytest.mark.parametrize(("key", "why"), [
    (r"(\w)\1", "uses a backreference at index 4"),
    (r"(?P<x>a)(?P=x)", "uses a backreference"),
    (r"(?=to_q)to_q", "uses a lookahead at index 0"),
    (r"(?<!x)to_q", "uses a lookbehind"),
    (r"(?>a|ab)c", "uses an atomic group"),
    (r"to_q*+", "uses a possessive quantifier"),
    (r"(?i:TO_Q)", "uses inline flags"),
    (r"(a)?(?(1)b|c)", "uses a conditional group"),
    ("a{5000}", "more than 4096 automaton states"),
    ("(a{100}){100}", "more than 4096 automaton states"),
    ("(" * 40 + "a" + ")" * 40, "groups nested deeper than 32 levels"),
    ("a|" * MAX_KEY_CHARS, f"has {2 * MAX_KEY_CHARS} characters"),
    ("to_q(", "is not a regular expression PEFT can use (missing )"),
])
def test_what_no_automaton_runs_is_refused_at_load(tmp_path, key, why):
    f = tmp_path / "a.safetensors"
    save_file({"to_q.lora_A.weight": torch.randn(2, 6), "to_q.lora_B.weight": torch.randn(8, 2)},
              str(f), metadata={"lora_adapter_metadata": json.dumps(
                  {"r": 2, "lora_alpha": 2, "rank_pattern": {key: 2}})})
    with pytest.raises(AdapterFormatError, match=re.escape(why)) as e:
        load_lora(f)
    assert "Rewrite the key" in str(e.value)
