"""Chroma adapters in lodestones' original (FLUX.1-derived) names on ChromaTransformer2DModel.

Oracles, none of which reads shuttle's table:
- diffusers' single-file converter ``convert_chroma_transformer_checkpoint_to_diffusers`` at real
  size: every original parameter holds, row by row, tags naming the diffusers parameter and row
  shuttle's table sends it to, and the converter must hand each diffusers parameter exactly its
  own tags;
- diffusers' LoRA path for Chroma (FluxLoraLoaderMixin: ``_convert_kohya_flux_lora_to_diffusers``)
  on the real-size kohya layout, row for row;
- on a tiny model, diffusers' own load + ``fuse_lora`` of the converted file, except the layers
  its LoRA converter cannot take: ``single_blocks.N.linear1`` (split at a hard-coded 3072) and
  the approximator (``distilled_guidance_layer``, which it rejects). Those are checked against
  float64 deltas split by the original code's row layout.
"""

from __future__ import annotations

import logging

import pytest
import torch

from shuttle.targets import ModelNames
from shuttle.targets.chroma import chroma_names
from tests.targets.family_layouts import load, lora_keys, original_layers
from tests.targets.family_layouts_mmdit import build, layout
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

LAYOUTS = ("chroma-kohya.json", "chroma-all-layers.json")


@pytest.fixture(scope="module")
def model():
    return build("chroma")


@pytest.mark.parametrize("alone", [False, True], ids=["all families", "this table alone"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_lands_at_real_size(name, alone, model):
    assert load(name) == layout(name, model)  # the file is what the table writes from the model
    with only(chroma_names if alone else None):
        reached = check_layout(load(name), model)
    layers = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if "kohya" in name:  # the double and single blocks' Linears
        layers = {n for n in layers if n.startswith(("transformer_blocks.",
                                                     "single_transformer_blocks."))}
    assert set().union(*reached.values()) == layers
    assert sum(len(v) > 1 for v in reached.values()) == 2 * 19 + 38  # qkv x2, linear1


def test_table_is_the_single_file_converters_map(model):
    from diffusers.loaders.single_file_utils import (
        convert_chroma_transformer_checkpoint_to_diffusers,
    )

    names = ModelNames.of(model)
    # Chroma's RMSNorms keep their weight as ``scale``
    checkpoint, tags = tagged_checkpoint(
        names, chroma_names.__wrapped__(names),
        lambda original, leaf: "scale" if original.endswith(("_norm", ".norm"))
        or ".norms." in original else leaf)
    converted = convert_chroma_transformer_checkpoint_to_diffusers(checkpoint)
    assert checkpoint == {}  # the converter took every original parameter
    assert set(converted) == set(names.shapes)  # none left without its original
    for param, value in converted.items():
        assert torch.equal(value, tags(param)), param


def test_kohya_rows_land_where_diffusers_puts_them(model):
    from diffusers.loaders import FluxLoraLoaderMixin

    sd, modules = tagged(load("chroma-kohya.json"))
    got, unmatched = shuttle_rows(sd, modules, model)
    assert unmatched == {}
    converted = FluxLoraLoaderMixin.lora_state_dict(dict(sd))
    assert got == converted_rows(converted, modules)


def tiny_chroma() -> torch.nn.Module:
    torch.manual_seed(0)
    model = diffusers.ChromaTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=12, axes_dims_rope=(2, 2, 4),
        approximator_num_channels=8, approximator_hidden_dim=24, approximator_layers=2)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def _float64_deltas(sd: dict[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    """diffusers parameter -> alpha / r * up @ down of the layers diffusers cannot convert."""
    out = {}
    for key in sd:
        if not key.endswith(".lora_down.weight"):
            continue
        name = key.removeprefix("lora_unet_").removesuffix(".lora_down.weight")
        down, up = sd[key].double(), sd[key.replace("lora_down", "lora_up")].double()
        delta = sd[key.replace("lora_down.weight", "alpha")].item() / down.shape[0] * up @ down
        if name.startswith("single_blocks_") and name.endswith("_linear1"):
            block = f"single_transformer_blocks.{name.split('_')[2]}"
            for k, d in enumerate(("attn.to_q", "attn.to_k", "attn.to_v")):
                out[f"{block}.{d}.weight"] = delta[k * hidden:(k + 1) * hidden]
            out[f"{block}.proj_mlp.weight"] = delta[3 * hidden:]
        elif name.startswith("distilled_guidance_layer_"):
            rest = name.removeprefix("distilled_guidance_layer_")
            rest = {"in_proj": "in_proj", "out_proj": "out_proj"}.get(rest) or (
                "layers.{}.{}".format(*rest.removeprefix("layers_").split("_", 1))
                .replace("in_layer", "linear_1").replace("out_layer", "linear_2"))
            out[f"distilled_guidance_layer.{rest}.weight"] = delta
    return out


def test_tiny_kohya_merge_equals_diffusers_load_and_fuse():
    from diffusers.loaders import FluxLoraLoaderMixin

    base = tiny_chroma()
    layers = original_layers(base, chroma_names.__wrapped__)
    g = torch.Generator().manual_seed(1)
    sd = {}
    for i, (key, shape) in enumerate(lora_keys(layers, "kohya").items()):
        sd[key] = torch.randn(*shape, generator=g) if shape else torch.tensor(float(1 + i % 5))
    # diffusers' converter ignores final_layer's alpha (it keeps scale 1): alpha = rank there
    sd["lora_unet_final_layer_linear.alpha"] = torch.tensor(16.0)
    float64 = {k: v for k, v in sd.items() if "_linear1." in k or "_distilled_guidance_" in k}
    assert len(float64) == 3 * (2 + 1 + 2 * 2 + 1)

    converted = FluxLoraLoaderMixin.lora_state_dict(
        {k: v.clone() for k, v in sd.items() if k not in float64})
    # The converter writes the layers outside the blocks without "transformer.", so that
    # load_lora_adapter(prefix="transformer") would drop them: put them where it looks.
    top = {"x_embedder", "context_embedder", "proj_out"}
    assert {k.split(".")[0] for k in converted if not k.startswith("transformer.")} == top
    converted = {k if k.startswith("transformer.") else f"transformer.{k}": v
                 for k, v in converted.items()}
    expected = fused_by_diffusers(base, converted, 0.7)
    with torch.no_grad():
        params = dict(expected.named_parameters())
        for name, delta in _float64_deltas(float64, hidden=16).items():
            params[name].copy_((params[name].double() + 0.7 * delta).float())

    report = merged_like(base, sd, expected, 0.7)
    assert len(report.applied) == sum(isinstance(m, torch.nn.Linear) for m in base.modules())
