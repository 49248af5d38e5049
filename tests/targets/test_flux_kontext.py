"""FLUX.1 Kontext and Krea adapters in BFL's names on diffusers' FluxTransformer2DModel.

FLUX.1-Kontext-dev and FLUX.1-Krea-dev have FLUX.1-dev's module tree and config (the Kontext
pipeline feeds the reference image's tokens through the same layers), so their adapters go
through the FLUX.1 table (:mod:`shuttle.targets.flux`). The layouts are named from BFL's own
module tree (:mod:`tests.targets.flux_bfl`), not from shuttle's table: kohya sd-scripts'
``lora_unet_double_blocks_0_img_attn_qkv`` (Kontext and Krea LoRAs alike) and fal's Kontext
trainer's ``base_model.model.double_blocks.0.img_attn.qkv.lora_A.weight``. Oracles: diffusers'
own converters for each (``_convert_kohya_flux_lora_to_diffusers``,
``_convert_fal_kontext_lora_to_diffusers``, chosen by FluxLoraLoaderMixin) at real size, row
for row.
"""

from __future__ import annotations

import logging

import pytest
import torch

from shuttle.targets.flux import flux_names
from tests.targets.family_layouts import load
from tests.targets.family_layouts_mmdit import build, layout
from tests.targets.family_oracle import check_layout, converted_rows, only, shuttle_rows, tagged

diffusers = pytest.importorskip("diffusers")
logging.getLogger("diffusers").setLevel(logging.ERROR)

LAYOUTS = ("flux-kontext-kohya.json", "flux-kontext-fal.json")


@pytest.fixture(scope="module")
def model():
    return build("flux")


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_lands_at_real_size(name, model):
    assert load(name) == layout(name)  # the file is BFL's module tree
    with only(flux_names):
        reached = check_layout(load(name), model)
    layers = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if "fal" in name:  # the blocks' Linears and the final projection
        layers = {n for n in layers if n.startswith(("transformer_blocks.",
                                                     "single_transformer_blocks.", "proj_out"))}
    assert set().union(*reached.values()) == layers
    assert sum(len(v) > 1 for v in reached.values()) == 2 * 19 + 38  # qkv x2, linear1


@pytest.mark.parametrize("name", LAYOUTS)
def test_rows_land_where_diffusers_puts_them(name, model):
    from diffusers.loaders import FluxLoraLoaderMixin

    sd, modules = tagged(load(name))
    got, unmatched = shuttle_rows(sd, modules, model)
    assert unmatched == {}
    converted = FluxLoraLoaderMixin.lora_state_dict(dict(sd))
    assert got == converted_rows(converted, modules)
