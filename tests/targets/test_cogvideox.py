"""CogVideoX adapters in THUDM's original (SAT) names on diffusers' CogVideoXTransformer3DModel.

The oracle is this file's own rewrite of diffusers' ``scripts/convert_cogvideox_to_diffusers.py``
(not shipped in the wheel): its ordered substring renames, then its special keys
(``query_key_value`` chunked in 3 by rows; the per-layer q/k LayerNorms; each
``adaLN_modulations.N.1`` chunked in 12, chunks 0-2 and 6-8 to ``norm1.linear`` and 3-5, 9-11 to
``norm2.linear``). It reads nothing of shuttle's table. Checks:
- real-size layouts (2B, ``diffusion_model.``; 5B, kohya) land whole on the meta model;
- tagged rows: a checkpoint whose weights are a tagged LoRA's up factors, converted by the
  oracle, puts every row where shuttle's resolution does;
- on tiny models, ``shuttle.merge_lora`` equals the float64 update converted by the oracle.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import shuttle
from shuttle.targets.cogvideox import cogvideox_names
from tests.targets.cogvideox_layouts import build, layout
from tests.targets.family_layouts import load, lora_keys, original_layers
from tests.targets.family_oracle import _split, check_layout, decode, only, shuttle_rows, tagged

diffusers = pytest.importorskip("diffusers")
logging.getLogger("diffusers").setLevel(logging.ERROR)

PREFIX = "model.diffusion_model."
# TRANSFORMER_KEYS_RENAME_DICT, in its order (substring replacements).
RENAMES = (
    ("transformer.final_layernorm", "norm_final"), ("transformer", "transformer_blocks"),
    ("attention", "attn1"), ("mlp", "ff.net"), ("dense_h_to_4h", "0.proj"),
    ("dense_4h_to_h", "2"), (".layers", ""), ("dense", "to_out.0"),
    ("input_layernorm", "norm1.norm"), ("post_attn1_layernorm", "norm2.norm"),
    ("time_embed.0", "time_embedding.linear_1"), ("time_embed.2", "time_embedding.linear_2"),
    ("ofs_embed.0", "ofs_embedding.linear_1"), ("ofs_embed.2", "ofs_embedding.linear_2"),
    ("mixins.patch_embed", "patch_embed"), ("mixins.final_layer.norm_final", "norm_out.norm"),
    ("mixins.final_layer.linear", "proj_out"),
    ("mixins.final_layer.adaLN_modulation.1", "norm_out.linear"),
)


def convert(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The conversion script's transformer pass on an original state dict."""
    renamed = {}
    for key, value in checkpoint.items():
        new = key.removeprefix(PREFIX)
        for old, repl in RENAMES:
            new = new.replace(old, repl)
        renamed[new] = value
    out = {}
    for key, value in renamed.items():
        parts = key.split(".")
        if "query_key_value" in key:
            for name, part in zip(("to_q", "to_k", "to_v"), value.chunk(3, dim=0), strict=True):
                out[key.replace("query_key_value", name)] = part
        elif "query_layernorm_list" in key or "key_layernorm_list" in key:
            norm = "norm_q" if "query" in key else "norm_k"
            out[f"transformer_blocks.{parts[-2]}.attn1.{norm}.{parts[-1]}"] = value
        elif "adaln_layer.adaLN_modulations" in key:
            c = value.chunk(12, dim=0)
            block = f"transformer_blocks.{parts[-3]}"
            out[f"{block}.norm1.linear.{parts[-1]}"] = torch.cat(c[0:3] + c[6:9])
            out[f"{block}.norm2.linear.{parts[-1]}"] = torch.cat(c[3:6] + c[9:12])
        else:
            out[key] = value
    return out


def test_oracle_renames_the_known_keys():
    block = "transformer.layers.3."
    names = [block + n for n in ("attention.query_key_value", "attention.dense",
                                 "mlp.dense_h_to_4h", "mlp.dense_4h_to_h",
                                 "post_attention_layernorm")]
    names += ["transformer.final_layernorm", "mixins.final_layer.adaLN_modulation.1",
              "mixins.adaln_layer.key_layernorm_list.3"]
    got = convert({f"{PREFIX}{n}.weight": torch.zeros(12, 1) for n in names})
    assert set(got) == {f"{p}.weight" for p in (
        "transformer_blocks.3.attn1.to_q", "transformer_blocks.3.attn1.to_k",
        "transformer_blocks.3.attn1.to_v", "transformer_blocks.3.attn1.to_out.0",
        "transformer_blocks.3.ff.net.0.proj", "transformer_blocks.3.ff.net.2",
        "transformer_blocks.3.norm2.norm", "norm_final", "norm_out.linear",
        "transformer_blocks.3.attn1.norm_k")}


MODELS = {"2b": ("cogvideox_2b", "cogvideox-2b-diffusion-model.json"),
          "5b": ("cogvideox_5b", "cogvideox-5b-kohya.json")}


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    kind, name = MODELS[request.param]
    return build(kind), name


def test_layout_lands_at_real_size(case):
    model, name = case
    assert load(name) == layout(name, model)  # the file is what the table writes from the model
    reached = check_layout(load(name), model)
    layers = {n for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)}
    assert set().union(*reached.values()) == layers
    blocks = sum(1 for n in layers if n.endswith(".attn1.to_q"))
    assert blocks == (30 if "2b" in name else 42) and len(reached) == 5 * blocks + 6
    fused = {k: v for k, v in reached.items() if len(v) > 1}
    assert len(fused) == 2 * blocks  # query_key_value (3 layers), adaLN_modulations (2)
    assert all(len(v) == (3 if "query_key_value" in k else 2) for k, v in fused.items())


def _dotted(model) -> dict[str, list[int]]:
    """A LoRA on every layer in ``model.diffusion_model.`` + original names (PEFT keys)."""
    return lora_keys(original_layers(model, cogvideox_names.__wrapped__), f"peft:{PREFIX}")


def _oracle_rows(sd, modules, dotted: list[str]) -> dict[str, list[tuple[str, int]]]:
    """diffusers module -> sources of its rows, from the oracle converting the up factors.

    A kohya key is read as the one of the ``dotted`` original names it underscores.
    """
    kohya = {"lora_unet_" + d.replace(".", "_"): d for d in dotted}
    checkpoint = {}
    for key, value in sd.items():
        module, kind = (None, None) if value.ndim < 2 else _split(key)
        if kind == "up":
            original = kohya.get(module) or module.removeprefix(PREFIX).removeprefix(
                "diffusion_model.")
            checkpoint[f"{PREFIX}{original}.weight"] = value
    return {k.removesuffix(".weight"): decode(v, modules) for k, v in convert(checkpoint).items()}


@pytest.mark.parametrize("alone", [False, True], ids=["all families", "this table alone"])
@pytest.mark.parametrize("spelling", ["file", "model.diffusion_model."])
def test_rows_land_where_the_conversion_script_puts_them(case, spelling, alone):
    model, name = case
    dotted = _dotted(model)
    sd, modules = tagged(load(name) if spelling == "file" else dotted)
    with only(cogvideox_names if alone else None):
        got, unmatched = shuttle_rows(sd, modules, model)
    assert unmatched == {}
    want = _oracle_rows(sd, modules, [_split(k)[0].removeprefix(PREFIX) for k in dotted])
    layers = {n for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)}
    assert set(want) == layers
    assert got == want


def tiny(**extra) -> torch.nn.Module:
    torch.manual_seed(0)
    model = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        time_embed_dim=12, text_embed_dim=10, num_layers=3, sample_width=8, sample_height=8,
        sample_frames=5, max_text_seq_length=6, **extra)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("extra", [
    {},  # CogVideoX 1.0: Conv2d patch embedding
    dict(use_rotary_positional_embeddings=True, patch_size_t=2, ofs_embed_dim=12),  # 1.5 I2V
], ids=["1.0", "1.5-ofs"])
def test_tiny_merge_equals_converted_update(extra):
    base = tiny(**extra)
    layers = original_layers(base, cogvideox_names.__wrapped__)
    assert ("ofs_embed.0" in layers) == bool(extra)
    g = torch.Generator().manual_seed(1)
    sd = {k: torch.randn(*s, generator=g) if s else torch.tensor(4.0)
          for k, s in lora_keys(layers, "diffusion_model").items()}
    strength = 0.7
    delta = {}
    for original in layers:
        key = f"diffusion_model.{original}"
        up = sd[f"{key}.lora_up.weight"].double()
        down = sd[f"{key}.lora_down.weight"].double()
        scale = strength * sd[f"{key}.alpha"].item() / down.shape[0]
        update = scale * (up.flatten(1) @ down.flatten(1))
        delta[f"{PREFIX}{original}.weight"] = update.reshape(up.shape[0], *down.shape[1:])
    converted = convert(delta)

    got = copy.deepcopy(base)
    report = shuttle.merge_lora(got, [(sd, strength)])
    assert report.unmatched == {}
    before = dict(base.named_parameters())
    assert set(converted) <= set(before)
    for name, p in got.named_parameters():
        want = before[name].double() + converted.get(name, 0)
        torch.testing.assert_close(p.double(), want, rtol=1e-5, atol=1e-5, msg=name)
    linears = {f"{n}.weight" for n, m in base.named_modules()
               if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)}
    assert set(converted) == linears
