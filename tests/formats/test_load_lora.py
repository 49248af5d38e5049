"""load_lora: every key spelling family, PEFT configs, scale rules, lazy files and errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from shuttle import load_lora
from shuttle.errors import (
    AdapterFileError,
    AdapterFormatError,
    UnknownKeyError,
    UnsupportedFormatError,
)
from shuttle.formats import FORMATS, LazyTensor, LoRA
from shuttle.patches import IA3, Diff, DoRA, LoHa, LoKr, LowRank, Set


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: dtype, shape and values."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def only(lora: LoRA, module: str):
    (patch,) = lora.modules[module]
    return patch


def kohya_sd(name="lora_unet_mid_block_attentions_0_proj_in", out_f=8, in_f=6, r=4,
             alpha: float | None = 2.0):
    sd = {f"{name}.lora_down.weight": torch.randn(r, in_f),
          f"{name}.lora_up.weight": torch.randn(out_f, r)}
    if alpha is not None:
        sd[f"{name}.alpha"] = torch.tensor(alpha)
    return sd


def write_peft_dir(path, tensors, config):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


# -- PEFT -------------------------------------------------------------------------------------

P = "base_model.model."


def test_peft_state_dict_without_config_scale_one():
    a, b = torch.randn(4, 6), torch.randn(8, 4)
    lora = load_lora({f"{P}blocks.0.attn.to_q.lora_A.weight": a,
                      f"{P}blocks.0.attn.to_q.lora_B.weight": b})
    assert lora.format == "peft"
    assert list(lora.modules) == [f"{P}blocks.0.attn.to_q"]
    p = only(lora, f"{P}blocks.0.attn.to_q")
    assert isinstance(p, LowRank) and p.param == "weight"
    assert p.up is b and p.down is a  # B is up, A is down
    assert p.scale == 1.0 and p.alpha is None and p.rank == 4
    assert not p.transposed and p.mid is None and not p.split_qkv
    assert lora.config is None and lora.skipped == {}


def test_peft_config_argument_gives_scale():
    sd = {f"{P}x.lora_A.weight": torch.randn(4, 6), f"{P}x.lora_B.weight": torch.randn(8, 4)}
    p = only(load_lora(sd, config={"r": 4, "lora_alpha": 6}), f"{P}x")
    assert p.scale == 6 / 4


def test_peft_default_adapter_name_spelling():
    a, b = torch.randn(2, 6), torch.randn(8, 2)
    lora = load_lora({f"{P}x.lora_A.default.weight": a, f"{P}x.lora_B.default.weight": b})
    assert lora.format == "peft"
    p = only(lora, f"{P}x")
    assert p.up is b and p.down is a
    # without the base_model prefix it is the diffusers spelling of the same thing
    lora = load_lora({"transformer.x.lora_A.default.weight": a,
                      "transformer.x.lora_B.default.weight": b})
    assert lora.format == "diffusers"
    assert only(lora, "transformer.x").up is b


def test_peft_lora_bias_takes_lora_scale():
    a, b, bias = torch.randn(2, 6), torch.randn(8, 2), torch.randn(8)
    lora = load_lora({f"{P}x.lora_A.weight": a, f"{P}x.lora_B.weight": b,
                      f"{P}x.lora_B.bias": bias}, config={"r": 2, "lora_alpha": 5})
    main, bias_patch = lora.modules[f"{P}x"]
    assert isinstance(main, LowRank) and main.scale == 2.5
    assert isinstance(bias_patch, Diff) and bias_patch.param == "bias"
    assert bias_patch.diff is bias and bias_patch.scale == 2.5


def test_peft_dora_magnitude_vector():
    a, b, m = torch.randn(2, 6), torch.randn(8, 2), torch.rand(8)
    lora = load_lora({f"{P}x.lora_A.weight": a, f"{P}x.lora_B.weight": b,
                      f"{P}x.lora_magnitude_vector": m}, config={"r": 2, "lora_alpha": 4})
    p = only(lora, f"{P}x")
    assert isinstance(p, DoRA) and p.mode == "inner" and p.magnitude is m
    assert isinstance(p.inner, LowRank) and p.inner.scale == 2.0
    assert p.rank == 2 and p.param == "weight"


def test_peft_embedding_factors_are_transposed():
    ea, eb = torch.randn(3, 20), torch.randn(5, 3)  # (r, vocab), (dim, r)
    lora = load_lora({f"{P}embed_tokens.lora_embedding_A": ea,
                      f"{P}embed_tokens.lora_embedding_B": eb},
                     config={"r": 3, "lora_alpha": 6})
    p = only(lora, f"{P}embed_tokens")
    assert isinstance(p, LowRank) and p.transposed
    assert p.down is ea and p.up is eb and p.scale == 2.0
    p.check((20, 5), "embed_tokens.weight")


def test_peft_directory_alpha_over_r(tmp_path):
    a, b = torch.randn(4, 6), torch.randn(8, 4)
    d = write_peft_dir(tmp_path / "ad", {f"{P}x.lora_A.weight": a, f"{P}x.lora_B.weight": b},
                       {"peft_type": "LORA", "r": 4, "lora_alpha": 16})
    lora = load_lora(d)
    assert lora.format == "peft" and lora.source == str(d)
    p = only(lora, f"{P}x")
    assert p.scale == 4.0 and p.rank == 4
    assert lora.config is not None and lora.config.r == 4 and lora.config.alpha == 16.0
    assert isinstance(p.up, LazyTensor) and isinstance(p.down, LazyTensor)
    loaded = only(lora.load(), f"{P}x")
    assert same(loaded.up, b) and same(loaded.down, a)


def test_peft_directory_rslora(tmp_path):
    tensors = {f"{P}x.lora_A.weight": torch.randn(4, 6), f"{P}x.lora_B.weight": torch.randn(8, 4)}
    d = write_peft_dir(tmp_path / "ad", tensors,
                       {"peft_type": "LORA", "r": 4, "lora_alpha": 6, "use_rslora": True})
    assert only(load_lora(d), f"{P}x").scale == pytest.approx(6 / math.sqrt(4), rel=1e-15)


def test_peft_directory_rank_and_alpha_patterns(tmp_path):
    tensors = {}
    for name, r in (("blocks.0.to_q", 8), ("blocks.0.to_k", 2), ("blocks.1.to_v", 4)):
        tensors[f"{P}{name}.lora_A.weight"] = torch.randn(r, 6)
        tensors[f"{P}{name}.lora_B.weight"] = torch.randn(6, r)
    d = write_peft_dir(tmp_path / "ad", tensors, {
        "peft_type": "LORA", "r": 8, "lora_alpha": 16,
        "rank_pattern": {"to_k": 2, "blocks.1.to_v": 4},
        "alpha_pattern": {"to_k": 3, "to_v": 10},
    })
    lora = load_lora(d)
    assert only(lora, f"{P}blocks.0.to_q").scale == 16 / 8
    assert only(lora, f"{P}blocks.0.to_k").scale == 3 / 2
    assert only(lora, f"{P}blocks.1.to_v").scale == 10 / 4
    assert lora.config.rank_for(f"{P}blocks.0.to_k") == 2
    assert lora.config.alpha_for(f"{P}blocks.1.to_v") == 10.0
    assert lora.config.alpha_for(f"{P}blocks.0.to_q") == 16.0


def test_peft_pattern_matches_whole_name_segments():
    cfg = {"r": 4, "lora_alpha": 4, "alpha_pattern": {"k": 8}}
    sd = {}
    for name in ("attn.k", "attn.to_k"):
        sd[f"{P}{name}.lora_A.weight"] = torch.randn(4, 3)
        sd[f"{P}{name}.lora_B.weight"] = torch.randn(3, 4)
    lora = load_lora(sd, config=cfg)
    assert only(lora, f"{P}attn.k").scale == 2.0
    assert only(lora, f"{P}attn.to_k").scale == 1.0  # "k" is not a whole segment of "to_k"


def test_peft_directory_dora_and_fan_in_fan_out(tmp_path):
    a, b, m = torch.randn(2, 6), torch.randn(10, 2), torch.rand(10)
    d = write_peft_dir(tmp_path / "ad", {f"{P}h.0.attn.c_attn.lora_A.weight": a,
                                         f"{P}h.0.attn.c_attn.lora_B.weight": b,
                                         f"{P}h.0.attn.c_attn.lora_magnitude_vector": m},
                       {"peft_type": "LORA", "r": 2, "lora_alpha": 1, "use_dora": True,
                        "fan_in_fan_out": True})
    lora = load_lora(d)
    p = only(lora, f"{P}h.0.attn.c_attn")
    assert isinstance(p, DoRA) and p.mode == "inner"
    assert p.inner.transposed and p.inner.scale == 0.5
    assert lora.config.fan_in_fan_out
    p.inner.check((6, 10), "c_attn.weight")  # Conv1D stores (in, out)


def test_peft_directory_bin(tmp_path):
    a, b = torch.randn(2, 6), torch.randn(8, 2)
    d = tmp_path / "ad"
    d.mkdir()
    torch.save({f"{P}x.lora_A.weight": a, f"{P}x.lora_B.weight": b}, d / "adapter_model.bin")
    (d / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 8}))
    p = only(load_lora(d), f"{P}x")
    assert p.scale == 4.0 and same(p.up, b) and same(p.down, a)


def test_peft_config_overridden_by_argument(tmp_path):
    tensors = {f"{P}x.lora_A.weight": torch.randn(2, 6), f"{P}x.lora_B.weight": torch.randn(8, 2)}
    d = write_peft_dir(tmp_path / "ad", tensors, {"r": 2, "lora_alpha": 8})
    assert only(load_lora(d, config={"r": 2, "lora_alpha": 1}), f"{P}x").scale == 0.5


def test_peft_config_from_safetensors_metadata(tmp_path):
    f = tmp_path / "pytorch_lora_weights.safetensors"
    save_file({"transformer.x.lora_A.weight": torch.randn(4, 6),
               "transformer.x.lora_B.weight": torch.randn(8, 4)}, str(f),
              metadata={"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 2})})
    lora = load_lora(f)
    assert only(lora, "transformer.x").scale == 0.5
    assert "lora_adapter_metadata" in lora.metadata


def test_peft_loha_config(tmp_path):
    r = 2
    t = {f"{P}x.hada_w1_a": torch.randn(6, r), f"{P}x.hada_w1_b": torch.randn(r, 5),
         f"{P}x.hada_w2_a": torch.randn(6, r), f"{P}x.hada_w2_b": torch.randn(r, 5)}
    d = write_peft_dir(tmp_path / "ad", t, {"peft_type": "LOHA", "r": r, "alpha": 3})
    lora = load_lora(d)
    assert lora.format == "peft"
    p = only(lora, f"{P}x")
    assert isinstance(p, LoHa) and p.scale == 1.5


def test_peft_lokr_full_factors_keep_alpha_over_r():
    # PEFT always uses alpha / r, even when neither factor is decomposed (LyCORIS forces 1).
    sd = {f"{P}x.lokr_w1": torch.randn(2, 2), f"{P}x.lokr_w2": torch.randn(3, 4)}
    p = only(load_lora(sd, config={"peft_type": "LOKR", "r": 4, "alpha": 2}), f"{P}x")
    assert isinstance(p, LoKr) and p.rank is None and p.scale == 0.5


@pytest.mark.parametrize("peft_type", ["IA3", "OFT", "BOFT", "VERA"])
def test_peft_unsupported_type(tmp_path, peft_type):
    tensors = {f"{P}x.lora_A.weight": torch.randn(2, 6), f"{P}x.lora_B.weight": torch.randn(8, 2)}
    d = write_peft_dir(tmp_path / "ad", tensors, {"peft_type": peft_type, "r": 2})
    with pytest.raises(UnsupportedFormatError, match=f"peft_type '{peft_type}'"):
        load_lora(d)


def test_peft_config_bad_field():
    sd = {f"{P}x.lora_A.weight": torch.randn(2, 6), f"{P}x.lora_B.weight": torch.randn(8, 2)}
    with pytest.raises(AdapterFormatError, match="r is 'many'; a rank must be a whole number"):
        load_lora(sd, config={"r": "many"})
    with pytest.raises(AdapterFormatError, match="must be a finite"):
        load_lora(sd, config={"r": 2, "lora_alpha": float("inf")})


def test_peft_directory_without_weights(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterFileError, match="adapter_model.safetensors"):
        load_lora(tmp_path)


# -- kohya ------------------------------------------------------------------------------------


def test_kohya_alpha_over_rank():
    sd = kohya_sd(r=4, alpha=2.0)
    lora = load_lora(sd)
    assert lora.format == "kohya"
    name = "lora_unet_mid_block_attentions_0_proj_in"
    assert list(lora.modules) == [name]
    p = only(lora, name)
    assert isinstance(p, LowRank)
    assert p.scale == 0.5 and p.alpha == 2.0 and p.rank == 4
    assert p.up is sd[f"{name}.lora_up.weight"] and p.down is sd[f"{name}.lora_down.weight"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_kohya_alpha_dtypes(dtype):
    sd = kohya_sd(r=8, alpha=None)
    sd["lora_unet_mid_block_attentions_0_proj_in.alpha"] = torch.tensor(4.0, dtype=dtype)
    assert only(load_lora(sd), "lora_unet_mid_block_attentions_0_proj_in").scale == 0.5


def test_kohya_alpha_zero_means_rank():
    p = only(load_lora(kohya_sd(r=4, alpha=0.0)), "lora_unet_mid_block_attentions_0_proj_in")
    assert p.scale == 1.0 and p.alpha == 0.0


def test_kohya_missing_alpha_scale_one():
    p = only(load_lora(kohya_sd(r=4, alpha=None)), "lora_unet_mid_block_attentions_0_proj_in")
    assert p.scale == 1.0 and p.alpha is None


def test_kohya_text_encoders_and_locon():
    sd = {**kohya_sd("lora_te1_text_model_encoder_layers_0_self_attn_q_proj", r=2, alpha=1.0),
          **kohya_sd("lora_te2_text_model_encoder_layers_0_mlp_fc1", r=4, alpha=8.0)}
    conv = "lora_unet_down_blocks_0_resnets_0_conv1"
    sd[f"{conv}.lora_down.weight"] = torch.randn(4, 3, 3, 3)
    sd[f"{conv}.lora_up.weight"] = torch.randn(5, 4, 1, 1)
    sd[f"{conv}.alpha"] = torch.tensor(1.0)
    lora = load_lora(sd)
    assert lora.format == "kohya"
    assert only(lora, "lora_te1_text_model_encoder_layers_0_self_attn_q_proj").scale == 0.5
    assert only(lora, "lora_te2_text_model_encoder_layers_0_mlp_fc1").scale == 2.0
    c = only(lora, conv)
    assert c.scale == 0.25 and c.mid is None
    c.check((5, 3, 3, 3), "conv1.weight")


def test_kohya_tucker_mid():
    name = "lora_unet_down_blocks_0_resnets_0_conv1"
    mid = torch.randn(4, 4, 3, 3)
    sd = {f"{name}.lora_down.weight": torch.randn(4, 3, 1, 1),
          f"{name}.lora_up.weight": torch.randn(5, 4, 1, 1),
          f"{name}.lora_mid.weight": mid, f"{name}.alpha": torch.tensor(2.0)}
    p = only(load_lora(sd), name)
    assert isinstance(p, LowRank) and p.mid is mid and p.scale == 0.5
    p.check((5, 3, 3, 3), "conv1.weight")


def test_kohya_dora_scale_is_blend():
    sd = kohya_sd(r=4, alpha=4.0)
    m = torch.rand(8, 1)
    sd["lora_unet_mid_block_attentions_0_proj_in.dora_scale"] = m
    p = only(load_lora(sd), "lora_unet_mid_block_attentions_0_proj_in")
    assert isinstance(p, DoRA) and p.mode == "blend" and p.magnitude is m
    assert isinstance(p.inner, LowRank) and p.inner.scale == 1.0


def test_kohya_flux_split_qkv():
    r, in_f = 2, 5
    up = torch.block_diag(torch.randn(4, r), torch.randn(4, r), torch.randn(4, r))
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    sd = {f"{name}.lora_down.weight": torch.randn(3 * r, in_f),
          f"{name}.lora_up.weight": up, f"{name}.alpha": torch.tensor(1.0)}
    p = only(load_lora(sd), name)
    assert p.split_qkv and p.scale == 1 / 6
    assert p.effective_scale == pytest.approx(1 / 2)
    # a dense up on the same name is an ordinary LoRA
    sd[f"{name}.lora_up.weight"] = torch.randn(12, 3 * r)
    assert only(load_lora(sd), name).effective_scale == 1 / 6
    # other module names are never split
    other = "lora_unet_double_blocks_0_img_attn_proj"
    sd2 = {k.replace(name, other): v for k, v in sd.items()}
    sd2[f"{other}.lora_up.weight"] = up
    assert not only(load_lora(sd2), other).split_qkv


def test_kohya_nan_alpha():
    sd = kohya_sd(alpha=float("nan"))
    with pytest.raises(AdapterFormatError, match="alpha must be finite"):
        load_lora(sd)


def test_kohya_alpha_not_scalar():
    sd = kohya_sd()
    sd["lora_unet_mid_block_attentions_0_proj_in.alpha"] = torch.tensor([1.0, 2.0])
    with pytest.raises(AdapterFormatError, match="one number"):
        load_lora(sd)


def test_up_without_down():
    sd = kohya_sd()
    del sd["lora_unet_mid_block_attentions_0_proj_in.lora_down.weight"]
    with pytest.raises(AdapterFormatError, match="lacks its down") as info:
        load_lora(sd)
    assert type(info.value) is AdapterFormatError


def test_down_without_up():
    sd = kohya_sd()
    del sd["lora_unet_mid_block_attentions_0_proj_in.lora_up.weight"]
    with pytest.raises(AdapterFormatError, match="lacks its up"):
        load_lora(sd)


# -- legacy diffusers -------------------------------------------------------------------------


@pytest.mark.parametrize("module,up_key,down_key", [
    ("unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.processor.to_q",
     "{m}_lora.up.weight", "{m}_lora.down.weight"),
    ("unet.mid_block.attentions.0.proj_in", "{m}.lora.up.weight", "{m}.lora.down.weight"),
    ("text_encoder.text_model.encoder.layers.0.self_attn.q_proj",
     "{m}.lora_linear_layer.up.weight", "{m}.lora_linear_layer.down.weight"),
])
def test_legacy_diffusers(module, up_key, down_key):
    up, down = torch.randn(8, 4), torch.randn(4, 6)
    lora = load_lora({up_key.format(m=module): up, down_key.format(m=module): down})
    assert lora.format == "diffusers-legacy"
    p = only(lora, module)
    assert p.up is up and p.down is down and p.scale == 1.0


def test_legacy_diffusers_with_alpha():
    m = "unet.mid_block.attentions.0.proj_in"
    lora = load_lora({f"{m}.lora.up.weight": torch.randn(8, 4),
                      f"{m}.lora.down.weight": torch.randn(4, 6), f"{m}.alpha": torch.tensor(1.0)})
    assert only(lora, m).scale == 0.25


# -- LyCORIS ----------------------------------------------------------------------------------


def test_lycoris_loha():
    name, r = "lycoris_blocks_0_attn_to_q", 4
    sd = {f"{name}.hada_w1_a": torch.randn(8, r), f"{name}.hada_w1_b": torch.randn(r, 6),
          f"{name}.hada_w2_a": torch.randn(8, r), f"{name}.hada_w2_b": torch.randn(r, 6),
          f"{name}.alpha": torch.tensor(2.0)}
    lora = load_lora(sd)
    assert lora.format == "lycoris"
    p = only(lora, name)
    assert isinstance(p, LoHa) and p.scale == 0.5 and p.alpha == 2.0 and p.t1 is None
    assert p.w1a is sd[f"{name}.hada_w1_a"] and p.w2b is sd[f"{name}.hada_w2_b"]


def test_lycoris_loha_tucker_kohya_name():
    name, r = "lora_unet_down_blocks_0_resnets_0_conv1", 2
    sd = {f"{name}.hada_w1_a": torch.randn(r, 5), f"{name}.hada_w1_b": torch.randn(r, 3),
          f"{name}.hada_w2_a": torch.randn(r, 5), f"{name}.hada_w2_b": torch.randn(r, 3),
          f"{name}.hada_t1": torch.randn(r, r, 3, 3), f"{name}.hada_t2": torch.randn(r, r, 3, 3),
          f"{name}.alpha": torch.tensor(1.0)}
    p = only(load_lora(sd), name)
    assert isinstance(p, LoHa) and p.t1 is sd[f"{name}.hada_t1"] and p.scale == 0.5
    p.check((5, 3, 3, 3), "conv1.weight")


def test_lycoris_loha_missing_factor():
    name = "lycoris_x"
    sd = {f"{name}.hada_w1_a": torch.randn(8, 2), f"{name}.hada_w1_b": torch.randn(2, 6),
          f"{name}.hada_w2_a": torch.randn(8, 2)}
    with pytest.raises(AdapterFormatError, match="hada_w2_b"):
        load_lora(sd)


def test_lycoris_lokr_full_factors_scale_one():
    sd = {"lycoris_x.lokr_w1": torch.randn(2, 2), "lycoris_x.lokr_w2": torch.randn(4, 3),
          "lycoris_x.alpha": torch.tensor(8.0)}
    p = only(load_lora(sd), "lycoris_x")
    assert isinstance(p, LoKr) and p.rank is None and p.scale == 1.0


def test_lycoris_lokr_decomposed_and_tucker():
    sd = {"lycoris_x.lokr_w1": torch.randn(2, 2), "lycoris_x.lokr_w2_a": torch.randn(4, 3),
          "lycoris_x.lokr_w2_b": torch.randn(3, 6), "lycoris_x.alpha": torch.tensor(1.5)}
    p = only(load_lora(sd), "lycoris_x")
    assert p.rank == 3 and p.scale == 0.5
    sd = {"lycoris_c.lokr_w1_a": torch.randn(2, 4), "lycoris_c.lokr_w1_b": torch.randn(4, 2),
          "lycoris_c.lokr_w2_a": torch.randn(2, 3), "lycoris_c.lokr_w2_b": torch.randn(2, 5),
          "lycoris_c.lokr_t2": torch.randn(2, 2, 3, 3), "lycoris_c.alpha": torch.tensor(2.0)}
    p = only(load_lora(sd), "lycoris_c")
    assert p.rank == 4 and p.scale == 0.5 and p.t2 is sd["lycoris_c.lokr_t2"]
    p.check((6, 10, 3, 3), "c.weight")


def test_lycoris_lokr_missing_w2_partner():
    sd = {"lycoris_x.lokr_w1": torch.randn(2, 2), "lycoris_x.lokr_w2_a": torch.randn(4, 3)}
    with pytest.raises(AdapterFormatError, match="lokr_w2_b"):
        load_lora(sd)


def test_lycoris_full_diff_and_norm():
    diff, diff_b = torch.randn(8, 6), torch.randn(8)
    w_norm, b_norm = torch.randn(6), torch.randn(6)
    lora = load_lora({"lycoris_proj.diff": diff, "lycoris_proj.diff_b": diff_b,
                      "lycoris_norm.w_norm": w_norm, "lycoris_norm.b_norm": b_norm})
    assert lora.format == "lycoris"
    (w, b) = lora.modules["lycoris_proj"]
    assert isinstance(w, Diff) and w.param == "weight" and w.diff is diff and w.scale == 1.0
    assert isinstance(b, Diff) and b.param == "bias" and b.diff is diff_b
    (nw, nb) = lora.modules["lycoris_norm"]
    assert (nw.param, nb.param) == ("weight", "bias")
    assert nw.diff is w_norm and nb.diff is b_norm


@pytest.mark.parametrize("on_input", [False, True])
def test_lycoris_ia3(on_input):
    w = torch.randn(6)
    lora = load_lora({"lycoris_mlp_fc1.weight": w,
                      "lycoris_mlp_fc1.on_input": torch.tensor(on_input)})
    assert lora.format == "lycoris"
    p = only(lora, "lycoris_mlp_fc1")
    assert isinstance(p, IA3) and p.weight is w and p.on_input is on_input


@pytest.mark.parametrize("key,kind", [
    ("oft_unet_x.oft_diag", "OFT"), ("lycoris_x.a1.weight", "GLoRA"),
    ("lycoris_x.b2.weight", "GLoRA"), ("base_model.model.x.oft_r", "OFT"),
])
def test_unsupported_formats(key, kind):
    with pytest.raises(UnsupportedFormatError, match=kind):
        load_lora({key: torch.randn(2, 2, 2)})


def test_an_oft_row_scale_without_its_blocks_names_them():
    with pytest.raises(AdapterFormatError, match="lacks its oft_blocks"):
        load_lora({"lycoris_x.rescale": torch.ones(4, 1)})


def test_two_factor_kinds_on_one_module():
    sd = {**kohya_sd("lycoris_x"), "lycoris_x.lokr_w1": torch.randn(2, 2),
          "lycoris_x.lokr_w2": torch.randn(4, 3)}
    with pytest.raises(AdapterFormatError, match="two kinds"):
        load_lora(sd)


# -- ComfyUI, XLabs, BFL control --------------------------------------------------------------


def test_comfy_dense_payloads():
    diff, diff_b, setw = torch.randn(8, 6), torch.randn(8), torch.randn(4)
    lora = load_lora({"diffusion_model.blocks.0.proj.diff": diff,
                      "diffusion_model.blocks.0.proj.diff_b": diff_b,
                      "diffusion_model.final_norm.set_weight": setw})
    assert lora.format == "comfy"
    w, b = lora.modules["diffusion_model.blocks.0.proj"]
    assert (w.kind, w.param, b.kind, b.param) == ("diff", "weight", "diff", "bias")
    assert w.diff is diff and b.diff is diff_b
    s = only(lora, "diffusion_model.final_norm")
    assert isinstance(s, Set) and s.param == "weight" and s.value is setw


def test_comfy_with_lora_factors():
    sd = {"diffusion_model.x.lora_A.weight": torch.randn(2, 6),
          "diffusion_model.x.lora_B.weight": torch.randn(8, 2),
          "diffusion_model.x.alpha": torch.tensor(1.0),
          "diffusion_model.x.diff_b": torch.randn(8)}
    lora = load_lora(sd)
    assert lora.format == "comfy"
    main, bias = lora.modules["diffusion_model.x"]
    assert main.kind == "lora" and main.scale == 0.5
    assert bias.kind == "diff" and bias.param == "bias" and bias.scale == 1.0


def test_comfy_set_weight_and_update_conflict():
    sd = {"diffusion_model.x.set_weight": torch.randn(8, 6),
          "diffusion_model.x.diff": torch.randn(8, 6)}
    with pytest.raises(AdapterFormatError, match="set_weight"):
        load_lora(sd)


def test_xlabs():
    up1, down1 = torch.randn(9, 2), torch.randn(2, 3)
    up2, down2 = torch.randn(3, 2), torch.randn(2, 3)
    sd = {"double_blocks.0.processor.qkv_lora1.down.weight": down1,
          "double_blocks.0.processor.qkv_lora1.up.weight": up1,
          "double_blocks.0.processor.proj_lora2.down.weight": down2,
          "double_blocks.0.processor.proj_lora2.up.weight": up2}
    lora = load_lora(sd)
    assert lora.format == "xlabs"
    assert set(lora.modules) == {"double_blocks.0.img_attn.qkv", "double_blocks.0.txt_attn.proj"}
    a = only(lora, "double_blocks.0.img_attn.qkv")
    assert a.up is up1 and a.down is down1 and a.scale == 1.0
    assert only(lora, "double_blocks.0.txt_attn.proj").up is up2


def test_bfl_control():
    qs, ks = torch.randn(16), torch.randn(16)
    a, b, bias = torch.randn(4, 128), torch.randn(64, 4), torch.randn(64)
    sd = {"double_blocks.0.img_attn.norm.query_norm.scale": qs,
          "double_blocks.0.img_attn.norm.key_norm.scale": ks,
          "img_in.lora_A.weight": a, "img_in.lora_B.weight": b, "img_in.lora_B.bias": bias}
    lora = load_lora(sd)
    assert lora.format == "bfl-control"
    q = only(lora, "double_blocks.0.img_attn.norm.query_norm")
    assert isinstance(q, Set) and q.param == "scale" and q.value is qs
    assert only(lora, "double_blocks.0.img_attn.norm.key_norm").value is ks
    main, bp = lora.modules["img_in"]
    assert main.up is b and main.down is a
    assert isinstance(bp, Diff) and bp.param == "bias" and bp.diff is bias


def test_format_registry_names():
    assert {"peft", "kohya", "lycoris", "diffusers", "diffusers-legacy", "comfy", "xlabs",
            "bfl-control"} <= set(FORMATS)


# -- LoRA object, describe --------------------------------------------------------------------


def test_describe_and_counts():
    sd = {**kohya_sd(r=4, alpha=2.0),
          "lora_unet_x.hada_w1_a": torch.randn(8, 2).half(),
          "lora_unet_x.hada_w1_b": torch.randn(2, 6).half(),
          "lora_unet_x.hada_w2_a": torch.randn(8, 2).half(),
          "lora_unet_x.hada_w2_b": torch.randn(2, 6).half(),
          "lora_unet_x.dora_scale": torch.rand(8, 1).half()}
    lora = load_lora(sd)
    assert len(lora) == 2
    assert lora.kinds() == {"lora": 1, "dora": 1}
    rows = {r["module"]: r for r in lora.describe()}
    lr = rows["lora_unet_mid_block_attentions_0_proj_in"]
    assert lr == {"module": "lora_unet_mid_block_attentions_0_proj_in", "param": "weight",
                  "kind": "lora", "rank": 4, "alpha": 2.0, "scale": 0.5,
                  "shapes": {"up": (8, 4), "down": (4, 6)}, "dtype": "float32",
                  "bytes": (32 + 24) * 4}
    d = rows["lora_unet_x"]
    assert d["kind"] == "dora" and d["rank"] == 2 and d["alpha"] is None and d["scale"] == 1.0
    assert d["dtype"] == "float16" and d["bytes"] == (8 + 16 + 12 + 16 + 12) * 2
    assert d["shapes"]["magnitude"] == (8, 1) and d["shapes"]["inner.w1a"] == (8, 2)
    assert lora.nbytes == lr["bytes"] + d["bytes"]
    assert lora.format == "lycoris"  # the hada_* keys name the file LyCORIS
    assert "format='lycoris'" in repr(lora) and "dora: 1" in repr(lora)


def test_load_lora_passes_lora_through():
    lora = load_lora(kohya_sd())
    assert load_lora(lora) is lora


# -- files ------------------------------------------------------------------------------------


def test_safetensors_is_lazy_until_load(tmp_path):
    sd = {**kohya_sd(r=4, alpha=2.0), "lora_unet_x.diff": torch.randn(3, 3).bfloat16()}
    f = tmp_path / "a.safetensors"
    save_file(sd, str(f), metadata={"ss_network_dim": "4"})
    lora = load_lora(f)
    assert lora.format == "kohya" and lora.source == str(f)
    assert lora.metadata == {"ss_network_dim": "4"}
    p = only(lora, "lora_unet_mid_block_attentions_0_proj_in")
    assert isinstance(p.up, LazyTensor) and isinstance(p.down, LazyTensor)
    assert p.scale == 0.5  # the 0-dim alpha is read at load time
    assert tuple(p.up.shape) == (8, 4) and p.up.dtype == torch.float32
    d = only(lora, "lora_unet_x")
    assert isinstance(d.diff, LazyTensor) and d.diff.dtype == torch.bfloat16
    assert lora.nbytes == (32 + 24) * 4 + 9 * 2

    loaded = lora.load()
    assert isinstance(loaded, LoRA) and loaded is not lora
    lp = only(loaded, "lora_unet_mid_block_attentions_0_proj_in")
    assert same(lp.up, sd["lora_unet_mid_block_attentions_0_proj_in.lora_up.weight"])
    assert same(lp.down, sd["lora_unet_mid_block_attentions_0_proj_in.lora_down.weight"])
    assert same(only(loaded, "lora_unet_x").diff, sd["lora_unet_x.diff"])
    assert isinstance(only(lora, "lora_unet_x").diff, LazyTensor)  # original still lazy


def test_path_as_string(tmp_path):
    f = tmp_path / "a.safetensors"
    save_file(kohya_sd(), str(f))
    assert load_lora(str(f)).format == "kohya"


@pytest.mark.parametrize("suffix", [".bin", ".pt"])
def test_pickle_files(tmp_path, suffix):
    sd = kohya_sd(r=2, alpha=1.0)
    f = tmp_path / f"a{suffix}"
    torch.save(sd, f)
    lora = load_lora(f)
    p = only(lora, "lora_unet_mid_block_attentions_0_proj_in")
    assert isinstance(p.up, torch.Tensor) and p.scale == 0.5
    assert same(p.up, sd["lora_unet_mid_block_attentions_0_proj_in.lora_up.weight"])
    # a {"state_dict": ...} wrapper is unwrapped
    torch.save({"state_dict": sd}, f)
    assert set(load_lora(f).modules) == {"lora_unet_mid_block_attentions_0_proj_in"}


def test_list_of_files(tmp_path):
    a = kohya_sd("lora_unet_a", alpha=1.0)
    b = kohya_sd("lora_unet_b", alpha=2.0)
    fa, fb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(a, str(fa))
    save_file(b, str(fb))
    lora = load_lora([fa, fb])
    assert set(lora.modules) == {"lora_unet_a", "lora_unet_b"}
    assert only(lora, "lora_unet_a").scale == 0.25 and only(lora, "lora_unet_b").scale == 0.5
    loaded = lora.load()
    assert same(only(loaded, "lora_unet_b").up, b["lora_unet_b.lora_up.weight"])


def test_list_of_files_split_module(tmp_path):
    sd = kohya_sd("lora_unet_a", alpha=1.0)
    fa, fb = tmp_path / "a.safetensors", tmp_path / "b.pt"
    save_file({k: v for k, v in sd.items() if "up" in k}, str(fa))
    torch.save({k: v for k, v in sd.items() if "up" not in k}, fb)
    p = only(load_lora([fa, fb]), "lora_unet_a")
    assert p.scale == 0.25
    assert same(p.load().down, sd["lora_unet_a.lora_down.weight"])


def test_duplicate_keys_across_files(tmp_path):
    sd = kohya_sd()
    fa, fb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(sd, str(fa))
    save_file({"lora_unet_mid_block_attentions_0_proj_in.alpha": torch.tensor(1.0)}, str(fb))
    with pytest.raises(AdapterFormatError, match="more than one of the files"):
        load_lora([fa, fb])


def test_two_spellings_of_one_role():
    a = torch.randn(2, 3)
    sd = {f"{P}x.lora_A.weight": a, f"{P}x.lora_A.default.weight": a,
          f"{P}x.lora_B.weight": torch.randn(4, 2)}
    with pytest.raises(AdapterFormatError, match="both give the 'down'"):
        load_lora(sd)


def test_missing_path(tmp_path):
    with pytest.raises(AdapterFileError, match="no such file"):
        load_lora(tmp_path / "missing.safetensors")
    with pytest.raises(AdapterFileError, match="no such file"):
        load_lora([tmp_path / "missing.pt"])


def test_unknown_extension_and_empty_list(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello")
    with pytest.raises(AdapterFileError, match="unknown adapter file type"):
        load_lora(f)
    with pytest.raises(AdapterFileError, match="empty list"):
        load_lora([])


def test_unknown_keys_strict():
    sd = {**kohya_sd(), "model.diffusion_model.input_blocks.0.0.weight": torch.randn(2, 2)}
    with pytest.raises(UnknownKeyError, match="input_blocks.0.0.weight.*strict=False"):
        load_lora(sd)


def test_unknown_keys_not_strict_are_skipped():
    sd = {**kohya_sd(), "model.diffusion_model.input_blocks.0.0.weight": torch.randn(2, 2),
          "lora_unet_orphan.alpha": torch.tensor(1.0),
          "bundle_emb.my_token.string_to_param.*": torch.randn(1, 4)}
    lora = load_lora(sd, strict=False)
    assert set(lora.modules) == {"lora_unet_mid_block_attentions_0_proj_in"}
    assert set(lora.skipped) == {"model.diffusion_model.input_blocks.0.0.weight",
                                 "lora_unet_orphan.alpha",
                                 "bundle_emb.my_token.string_to_param.*"}
    assert "strict=False" in lora.skipped["model.diffusion_model.input_blocks.0.0.weight"]
    assert "alpha without factors" in lora.skipped["lora_unet_orphan.alpha"]
    assert "textual inversion" in lora.skipped["bundle_emb.my_token.string_to_param.*"]


def test_no_update_at_all():
    with pytest.raises(AdapterFormatError, match="no key forms an update"):
        load_lora({"lora_unet_x.alpha": torch.tensor(1.0)})
    with pytest.raises(AdapterFormatError, match="holds no tensors"):
        load_lora({})


def test_non_tensor_values():
    with pytest.raises(AdapterFormatError, match="must be tensors"):
        load_lora({"lora_unet_x.alpha": 1.0})


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.uint8, torch.bool])
def test_integer_factors_are_refused(tmp_path, dtype):
    """Integer factors would be merged as numbers (weights moved by ~4e8)."""
    f = tmp_path / "int.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.ones(4, 16, dtype=dtype),
               "lora_unet_x.lora_up.weight": torch.ones(32, 4),
               "lora_unet_x.alpha": torch.tensor(4)}, str(f))  # an integer alpha is fine
    with pytest.raises(AdapterFormatError, match=r"'lora_unet_x.lora_down.weight' is "
                                                 r"(int|uint|bool).*must be floating point"):
        load_lora(f)
