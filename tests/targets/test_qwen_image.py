"""Qwen-Image adapters in their trainers' names on diffusers' QwenImageTransformer2DModel.

Qwen-Image's own code is diffusers' (ComfyUI's port keeps its names), so no family table is
needed: ``diffusion_model.transformer_blocks.0.img_mod.1`` (ComfyUI, diffusion-pipe) lands by
prefix, and musubi-tuner's kohya ``lora_unet_transformer_blocks_0_attn_add_q_proj`` by the
model's own names spelled forward. Oracles: diffusers' converter
``_convert_non_diffusers_qwen_lora_to_diffusers`` on the real-size layouts, row for row; on a
tiny model, diffusers' own load + ``fuse_lora`` of the converted file.
"""

from __future__ import annotations

import logging

import pytest
import torch

from shuttle.targets import FAMILY_MAPS
from tests.targets.family_layouts import load, lora_keys
from tests.targets.family_layouts_mmdit import build, layout, table_of
from tests.targets.family_oracle import (
    check_layout,
    converted_rows,
    fused_by_diffusers,
    merged_like,
    shuttle_rows,
    tagged,
)

diffusers = pytest.importorskip("diffusers")
logging.getLogger("diffusers").setLevel(logging.ERROR)

LAYOUTS = ("qwen-image-musubi.json", "qwen-image-diffusion-model.json")


@pytest.fixture(scope="module")
def model():
    return build("qwen_image")


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_lands_at_real_size_without_a_family_table(name, model):
    saved = list(FAMILY_MAPS)
    FAMILY_MAPS.clear()
    try:
        assert load(name) == layout(name, model)
        reached = check_layout(load(name), model)
    finally:
        FAMILY_MAPS[:] = saved
    layers = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if "musubi" in name:
        layers = {n for n in layers if n.startswith("transformer_blocks.")}
    assert set().union(*reached.values()) == layers
    assert all(len(v) == 1 for v in reached.values())


@pytest.mark.parametrize("name", LAYOUTS)
def test_rows_land_where_diffusers_puts_them(name, model):
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_qwen_lora_to_diffusers,
    )

    sd, modules = tagged(load(name))
    got, unmatched = shuttle_rows(sd, modules, model)
    assert unmatched == {}
    converted = _convert_non_diffusers_qwen_lora_to_diffusers(dict(sd))
    assert got == converted_rows(converted, modules)


def tiny_qwen_image() -> torch.nn.Module:
    torch.manual_seed(0)
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=12, axes_dims_rope=(2, 2, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("style", ["kohya", "diffusion_model"])
def test_tiny_merge_equals_diffusers_load_and_fuse(style):
    from diffusers.loaders import QwenImageLoraLoaderMixin

    base = tiny_qwen_image()
    layers = table_of("qwen_image")(base)
    g = torch.Generator().manual_seed(1)
    sd = {}
    for i, (key, shape) in enumerate(lora_keys(layers, style).items()):
        sd[key] = torch.randn(*shape, generator=g) if shape else torch.tensor(float(1 + i % 5))

    converted = QwenImageLoraLoaderMixin.lora_state_dict({k: v.clone() for k, v in sd.items()})
    expected = fused_by_diffusers(base, converted, 0.7)

    report = merged_like(base, sd, expected, 0.7)
    assert len(report.applied) == len(layers)
