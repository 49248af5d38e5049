"""The Flux name table: BFL-layout adapters on diffusers-layout models and back.

Oracle: diffusers' own kohya Flux converter (``_convert_kohya_flux_lora_to_diffusers``) turns a
BFL-named kohya LoRA into diffusers-named factors (alpha folded in, the final adaLN halves
swapped). The update shuttle places on each diffusers parameter must equal ``B @ A`` of the
converted factors; and the converted (diffusers-named) LoRA placed on a BFL-layout model must
give the BFL-layout update of the original. Only shapes are needed: models are dicts of
parameter shapes (hidden 3072 and MLP 12288, which the converter assumes, with few inputs).
"""

from __future__ import annotations

import logging

import pytest
import torch

import shuttle
from shuttle.targets import ModelNames

H, M, IN, R = 3072, 12288, 6, 4

# BFL module (kohya spelling) -> rows of its weight
BFL = {
    "double_blocks_0_img_attn_qkv": 3 * H, "double_blocks_0_txt_attn_qkv": 3 * H,
    "double_blocks_0_img_attn_proj": H, "double_blocks_0_txt_attn_proj": H,
    "double_blocks_0_img_mlp_0": M, "double_blocks_0_img_mlp_2": H,
    "double_blocks_0_img_mod_lin": 6 * H, "double_blocks_0_txt_mod_lin": 6 * H,
    "single_blocks_0_linear1": 3 * H + M, "single_blocks_0_linear2": H,
    "single_blocks_0_modulation_lin": 3 * H, "final_layer_adaLN_modulation_1": 2 * H,
    "final_layer_linear": 64,
}


def _kohya() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i, (name, rows) in enumerate(BFL.items()):
        sd[f"lora_unet_{name}.lora_down.weight"] = torch.randn(R, IN, generator=g)
        sd[f"lora_unet_{name}.lora_up.weight"] = torch.randn(rows, R, generator=g)
        # diffusers' converter ignores the alpha of the final layer's two modules (it keeps
        # scale 1 there): give those alpha = rank so that both readings agree.
        alpha = float(R) if name.startswith("final_layer") else float(1 + i % 3)
        sd[f"lora_unet_{name}.alpha"] = torch.tensor(alpha)
    return sd


def _converted(kohya):
    pytest.importorskip("diffusers")
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    return _convert_kohya_flux_lora_to_diffusers({k: v.clone() for k, v in kohya.items()})


def _bfl_shapes() -> dict[str, tuple[int, int]]:
    return {name.replace("double_blocks_0_", "double_blocks.0.")
            .replace("single_blocks_0_", "single_blocks.0.")
            .replace("img_attn_", "img_attn.").replace("txt_attn_", "txt_attn.")
            .replace("img_mlp_", "img_mlp.").replace("img_mod_lin", "img_mod.lin")
            .replace("txt_mod_lin", "txt_mod.lin").replace("modulation_lin", "modulation.lin")
            .replace("final_layer_adaLN_modulation_1", "final_layer.adaLN_modulation.1")
            .replace("final_layer_linear", "final_layer.linear") + ".weight": (rows, IN)
            for name, rows in BFL.items()}


def _deltas(lora, shapes) -> dict[str, torch.Tensor]:
    """The float64 update shuttle places on each parameter, rows assembled."""
    res = shuttle.resolve(lora, ModelNames(shapes))
    assert res.unmatched == {}
    out = {}
    for t in res.targets:
        full = out.setdefault(t.param, torch.zeros(shapes[t.param], dtype=torch.float64))
        r0, r1 = t.rows or (0, shapes[t.param][0])
        full[r0:r1] += t.patch.load().delta((r1 - r0, IN)).double()
    return out


def test_bfl_adapter_on_a_diffusers_model_matches_diffusers_converter():
    kohya = _kohya()
    converted = _converted(kohya)
    # module name -> its key prefix (the converter writes top-level layers without
    # "transformer.")
    modules = {k.removeprefix("transformer.").removesuffix(".lora_A.weight"):
               k.removesuffix(".lora_A.weight") for k in converted if k.endswith(".lora_A.weight")}
    shapes = {f"{m}.weight": (converted[f"{key}.lora_B.weight"].shape[0], IN)
              for m, key in modules.items()}
    got = _deltas(shuttle.load_lora(kohya), shapes)
    assert set(got) == set(shapes)
    for m, key in modules.items():
        a = converted[f"{key}.lora_A.weight"].double()
        b = converted[f"{key}.lora_B.weight"].double()
        torch.testing.assert_close(got[f"{m}.weight"], b @ a, rtol=1e-5, atol=1e-5)


def test_diffusers_adapter_on_a_bfl_model_gives_the_bfl_update():
    kohya = _kohya()
    diffusers_named = {k: v for k, v in _converted(kohya).items() if "lora_" in k}
    lora = shuttle.load_lora(diffusers_named)
    assert lora.format == "diffusers"
    shapes = _bfl_shapes()
    got = _deltas(lora, shapes)
    want = _deltas(shuttle.load_lora(kohya), shapes)
    assert set(got) == set(want) == set(shapes)
    for name in shapes:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)


def test_split_keeps_the_kohya_split_qkv_scale():
    """A kohya split-qkv save split over to_q/k/v keeps alpha / r per split (read from the
    whole block-diagonal up, not from one slice of it)."""
    g = torch.Generator().manual_seed(1)
    ups = [torch.randn(H, 2, generator=g) for _ in range(3)]
    up = torch.block_diag(*ups)
    downs = [torch.randn(2, IN, generator=g) for _ in range(3)]
    sd = {"lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": up,
          "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.cat(downs),
          "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(2.0)}
    shapes = {f"transformer_blocks.0.attn.{n}.weight": (H, IN)
              for n in ("to_q", "to_k", "to_v")}
    shapes["single_transformer_blocks.0.proj_mlp.weight"] = (M, IN)
    got = _deltas(shuttle.load_lora(sd), shapes)
    for n, u, d in zip(("to_q", "to_k", "to_v"), ups, downs, strict=True):
        torch.testing.assert_close(got[f"transformer_blocks.0.attn.{n}.weight"],
                                   u.double() @ d.double() * (2.0 / 2), rtol=1e-6, atol=1e-6)


def test_merge_through_the_table_on_a_real_module_tree():
    """merge_lora uses the table by itself: a BFL-named LoRA on a small diffusers-layout model."""
    torch.manual_seed(0)
    m = torch.nn.Module()
    blocks = torch.nn.ModuleList([torch.nn.Module()])
    blocks[0].attn = torch.nn.Module()
    for n in ("to_q", "to_k", "to_v"):
        setattr(blocks[0].attn, n, torch.nn.Linear(IN, H, bias=False))
    m.transformer_blocks = blocks
    single = torch.nn.ModuleList([torch.nn.Module()])
    single[0].proj_mlp = torch.nn.Linear(IN, M, bias=False)
    m.single_transformer_blocks = single
    sd = {k: v for k, v in _kohya().items() if "img_attn_qkv" in k}
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    report = shuttle.merge_lora(m, [(sd, 0.5)])
    assert sorted(report.applied) == [f"transformer_blocks.0.attn.{n}.weight"
                                      for n in ("to_k", "to_q", "to_v")]
    up = sd["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"]
    down = sd["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"]
    delta = 0.5 * (1.0 / R) * up @ down
    for k, n in enumerate(("to_q", "to_k", "to_v")):
        name = f"transformer_blocks.0.attn.{n}.weight"
        torch.testing.assert_close(dict(m.named_parameters())[name],
                                   before[name] + delta[k * H:(k + 1) * H])
