"""HunyuanVideo adapters in Tencent's original names on diffusers' HunyuanVideoTransformer3DModel.

Oracles, none of which reads shuttle's table:
- diffusers' single-file converter ``convert_hunyuan_video_transformer_to_diffusers`` (fused qkv
  and ``linear1`` split by rows, the final adaLN halves swapped) at real size: every original
  parameter holds, row by row, tags naming the diffusers parameter and row shuttle's table sends
  it to, and the converter must hand each diffusers parameter exactly its own tags;
- diffusers' LoRA converter ``_convert_hunyuan_video_lora_to_diffusers`` on the real-size
  layouts, row for row;
- on a tiny model, diffusers' own load + ``fuse_lora`` of the converted file, except three
  layers its LoRA converter cannot take at toy sizes or at all: ``single_blocks.N.linear1``
  (split at a hard-coded hidden size of 3072), and the final adaLN projection and the token
  refiner's ``self_attn_qkv`` (it cuts ``lora_A``'s rank rows as it cuts ``lora_B``'s output
  rows). Those are checked against float64 deltas split by the original code's row layout.
"""

from __future__ import annotations

import logging

import pytest
import torch

from shuttle.targets import ModelNames
from shuttle.targets.hunyuan_video import hunyuan_video_names
from tests.targets.family_layouts import build, layout, load, lora_keys, original_layers
from tests.targets.family_oracle import (
    check_layout,
    converted_rows,
    fused_by_diffusers,
    merged_like,
    only,
    shuttle_rows,
    tagged,
    tagged_checkpoint,
)

diffusers = pytest.importorskip("diffusers")
logging.getLogger("diffusers").setLevel(logging.ERROR)

LAYOUTS = ("hunyuan-video-diffusion-pipe.json", "hunyuan-video-all-layers.json")
LAYERS = (torch.nn.Linear, torch.nn.Conv3d)
# Layers diffusers' LoRA converter cuts wrongly (see the module docstring).
_CUT_WRONGLY = ("final_layer.adaLN_modulation.1", "self_attn_qkv")


@pytest.fixture(scope="module")
def model():
    return build("hunyuan_video")


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_lands_at_real_size(name, model):
    assert load(name) == layout(name, model)  # the file is what the table writes from the model
    reached = check_layout(load(name), model)
    layers = {n for n, m in model.named_modules() if isinstance(m, LAYERS)}
    if "diffusion-pipe" in name:  # the 320 Linears of the double and single blocks
        assert len(reached) == 320
        layers = {n for n in layers if n.startswith(("transformer_blocks.",
                                                     "single_transformer_blocks."))}
    assert set().union(*reached.values()) == layers
    fused = {k: v for k, v in reached.items() if len(v) > 1}
    assert {k.split(".", 2)[-1].rsplit(".", 1)[-1] for k in fused} == (
        {"img_attn_qkv", "txt_attn_qkv", "linear1"} if "diffusion-pipe" in name
        else {"img_attn_qkv", "txt_attn_qkv", "linear1", "self_attn_qkv"})


def test_table_is_the_single_file_converters_map(model):
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers

    names = ModelNames.of(model)
    checkpoint, tags = tagged_checkpoint(names, hunyuan_video_names.__wrapped__(names))
    converted = convert_hunyuan_video_transformer_to_diffusers(checkpoint)
    # Parameters without an original counterpart would be missing here.
    assert set(converted) == set(names.shapes)
    for param, value in converted.items():
        assert torch.equal(value, tags(param)), param


@pytest.mark.parametrize("alone", [False, True], ids=["all families", "this table alone"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_rows_land_where_diffusers_puts_them(name, alone, model):
    from diffusers.loaders.lora_conversion_utils import _convert_hunyuan_video_lora_to_diffusers

    sd, modules = tagged(load(name))
    with only(hunyuan_video_names if alone else None):
        got, unmatched = shuttle_rows(sd, modules, model)
    assert unmatched == {}
    converted = _convert_hunyuan_video_lora_to_diffusers(
        {k: v for k, v in sd.items() if not any(c in k for c in _CUT_WRONGLY)})
    want = converted_rows(converted, modules)
    if "all-layers" in name:  # (shift, scale) -> (scale, shift); q, k, v by thirds
        h = 3072
        source = "transformer.final_layer.adaLN_modulation.1"
        want["norm_out.linear"] = ([(source, h + j) for j in range(h)]
                                   + [(source, j) for j in range(h)])
        for i in range(2):
            block = f"context_embedder.token_refiner.refiner_blocks.{i}.attn"
            source = f"transformer.txt_in.individual_token_refiner.blocks.{i}.self_attn_qkv"
            for k, d in enumerate(("to_q", "to_k", "to_v")):
                want[f"{block}.{d}"] = [(source, k * h + j) for j in range(h)]
    assert got == want


def tiny_hunyuan_video() -> torch.nn.Module:
    torch.manual_seed(0)
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def _float64_deltas(sd: dict[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    """diffusers parameter -> B @ A rows of the fused layers, by the original row layout."""
    out = {}
    for key in sd:
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
        delta = sd[key.replace("lora_A", "lora_B")].double() @ sd[key].double()
        h = hidden
        if module.startswith("single_blocks.") and module.endswith(".linear1"):
            block = module.replace("single_blocks", "single_transformer_blocks")[:-8]
            for k, d in enumerate(("attn.to_q", "attn.to_k", "attn.to_v")):
                out[f"{block}.{d}.weight"] = delta[k * h:(k + 1) * h]
            out[f"{block}.proj_mlp.weight"] = delta[3 * h:]
        elif module.endswith(".self_attn_qkv"):
            i = module.split(".")[-2]
            block = f"context_embedder.token_refiner.refiner_blocks.{i}.attn"
            for k, d in enumerate(("to_q", "to_k", "to_v")):
                out[f"{block}.{d}.weight"] = delta[k * h:(k + 1) * h]
        elif module == "final_layer.adaLN_modulation.1":  # (shift, scale) -> (scale, shift)
            out["norm_out.linear.weight"] = torch.cat([delta[h:], delta[:h]])
    return out


def test_tiny_merge_equals_diffusers_load_and_fuse():
    from diffusers.loaders import HunyuanVideoLoraLoaderMixin

    base = tiny_hunyuan_video()
    layers = original_layers(base, hunyuan_video_names.__wrapped__)
    g = torch.Generator().manual_seed(1)
    sd = {k: torch.randn(*s, generator=g)
          for k, s in lora_keys(layers, "peft:transformer.").items()}
    float64 = {k: v for k, v in sd.items()
               if any(c in k for c in _CUT_WRONGLY) or ".linear1." in k}
    assert len(float64) == 2 * (1 + 1 + 2)

    converted = HunyuanVideoLoraLoaderMixin.lora_state_dict(
        {k: v.clone() for k, v in sd.items() if k not in float64})
    expected = fused_by_diffusers(base, converted, 0.7)
    with torch.no_grad():
        params = dict(expected.named_parameters())
        for name, delta in _float64_deltas(float64, hidden=16).items():
            params[name].copy_((params[name].double() + 0.7 * delta).float())

    report = merged_like(base, sd, expected, 0.7)
    assert len(report.applied) == sum(isinstance(m, LAYERS) for m in base.modules())
