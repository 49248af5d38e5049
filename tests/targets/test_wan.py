"""Wan 2.1 / 2.2 adapters in the original Wan names on diffusers' WanTransformer3DModel.

Oracles, none of which reads shuttle's table:
- diffusers' single-file converter ``convert_wan_transformer_to_diffusers`` passes values
  through, so a Wan checkpoint whose values are their own diffusers names comes back unchanged;
- diffusers' Wan LoRA converters (``_convert_non_diffusers_wan_lora_to_diffusers`` for
  ``diffusion_model.`` keys, ``_convert_musubi_wan_lora_to_diffusers`` for musubi-tuner's
  ``lora_unet_`` keys) on the real-size layouts, row for row;
- on a tiny model, diffusers' own load of the file + ``fuse_lora``.
Wan 2.2's A14B experts have Wan 2.1 14B's names and shapes; the 5B has its names.
"""

from __future__ import annotations

import logging

import pytest
import torch

from shuttle.targets import ModelNames
from shuttle.targets.wan import wan_names
from tests.targets.family_layouts import build, layout, load, lora_keys, original_layers
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

LAYOUTS = {"wan21-t2v-14b-musubi.json": "wan_t2v", "wan21-i2v-14b-diffusion-model.json": "wan_i2v"}
LAYERS = (torch.nn.Linear, torch.nn.Conv3d)


@pytest.fixture(scope="module")
def real():
    return {kind: build(kind) for kind in set(LAYOUTS.values())}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_lands_at_real_size(name, real):
    model = real[LAYOUTS[name]]
    assert load(name) == layout(name, model)  # the file is what the table writes from the model
    reached = check_layout(load(name), model)
    assert all(len(v) == 1 for v in reached.values())
    layers = {n for n, m in model.named_modules() if isinstance(m, LAYERS)}
    if "musubi" in name:  # musubi-tuner trains the blocks' Linears
        layers = {n for n in layers if n.startswith("blocks.")}
    assert set().union(*reached.values()) == layers


@pytest.mark.parametrize("kind", ["wan_t2v", "wan_i2v"])
def test_table_is_the_single_file_converters_map(kind, real):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    names = ModelNames.of(real[kind])
    wan_of = {place: wan for wan, place in wan_names.__wrapped__(names).items()}
    checkpoint = {}
    for param in names.shapes:
        module, leaf = param.rsplit(".", 1) if "." in param else ("", param)
        wan = wan_of[param] if param in wan_of else f"{wan_of[module]}.{leaf}"
        checkpoint[f"model.diffusion_model.{wan}"] = param
    assert convert_wan_transformer_to_diffusers(checkpoint) == {p: p for p in names.shapes}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_rows_land_where_diffusers_puts_them(name, real):
    from diffusers.loaders.lora_conversion_utils import (
        _convert_musubi_wan_lora_to_diffusers,
        _convert_non_diffusers_wan_lora_to_diffusers,
    )

    sd, modules = tagged(load(name))
    got, unmatched = shuttle_rows(sd, modules, real[LAYOUTS[name]])
    assert unmatched == {}
    if "musubi" in name:
        converted = _convert_musubi_wan_lora_to_diffusers(dict(sd))
    else:  # diffusers' converter refuses patch_embedding (shuttle's plain names place it)
        converted = _convert_non_diffusers_wan_lora_to_diffusers(
            {k: v for k, v in sd.items() if ".patch_embedding." not in k})
        assert got.pop("patch_embedding")[0][0] == "diffusion_model.patch_embedding"
    assert got == converted_rows(converted, modules)


def tiny_wan() -> torch.nn.Module:
    """Wan 2.1 I2V's layout at toy widths (image key/value projections, image embedder)."""
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=8, ffn_dim=32, num_layers=2, image_dim=12,
        added_kv_proj_dim=16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("style", ["diffusion_model", "kohya"])
def test_tiny_merge_equals_diffusers_load_and_fuse(style):
    from diffusers.loaders import WanLoraLoaderMixin

    base = tiny_wan()
    layers = original_layers(base, wan_names.__wrapped__)
    if style == "kohya":  # musubi-tuner: the blocks' Linears
        layers = {k: v for k, v in layers.items() if k.startswith("blocks.")}
    else:  # diffusers' converter refuses patch_embedding
        del layers["patch_embedding"]
    g = torch.Generator().manual_seed(1)
    sd = {}
    for i, (key, shape) in enumerate(lora_keys(layers, style).items()):
        if shape != []:
            sd[key] = torch.randn(*shape, generator=g)
        elif "blocks" in key:  # diffusers' converter reads no alpha outside the blocks
            sd[key] = torch.tensor(float(1 + i % 5))

    converted = WanLoraLoaderMixin.lora_state_dict({k: v.clone() for k, v in sd.items()})
    expected = fused_by_diffusers(base, converted, 0.7)

    report = merged_like(base, sd, expected, 0.7)
    assert len(report.applied) == len(layers)
