"""Lumina-Image 2.0 and Z-Image adapters in NextDiT's original names on their diffusers models.

Oracles, none of which reads shuttle's tables:
- diffusers' single-file converters (``convert_lumina2_to_diffusers``,
  ``convert_z_image_transformer_checkpoint_to_diffusers``; fused ``attention.qkv`` split by
  rows) at real size: every original parameter holds, row by row, tags naming the diffusers
  parameter and row shuttle's table sends it to, and the converter must hand each diffusers
  parameter exactly its own tags;
- diffusers' LoRA converters (``_convert_non_diffusers_lumina2_lora_to_diffusers``,
  ``_convert_non_diffusers_z_image_lora_to_diffusers``) on the real-size layouts, row for row,
  for the keys they take: Lumina2's raises on any key outside the blocks, Z-Image's leaves
  kohya's ``x_embedder``/``final_layer`` keys on names its model lacks;
- on tiny models, diffusers' own load + ``fuse_lora``: Lumina2's keys renamed by its
  single-file converter (its LoRA converter splits ``qkv`` at Lumina-Image 2.0's hard-coded
  2304/768/768 rows, so at toy sizes ``qkv`` is checked in float64, split by the model's query
  and grouped key/value heights); Z-Image's kohya file through its LoRA converter, with
  ``x_embedder``/``final_layer`` in float64.
"""

from __future__ import annotations

import logging

import pytest
import torch

from shuttle.targets import ModelNames
from shuttle.targets.lumina2 import lumina2_names, z_image_names
from tests.targets.family_layouts import load, lora_keys, original_layers
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
from tests.targets.ltx_lumina_layouts import build, layout

diffusers = pytest.importorskip("diffusers")
logging.getLogger("diffusers").setLevel(logging.ERROR)

LAYOUTS = {"lumina2-diffusion-model.json": ("lumina2", lumina2_names),
           "z-image-turbo-kohya.json": ("z_image", z_image_names)}
_OUTSIDE_BLOCKS = ("x_embedder", "t_embedder", "cap_embedder", "final_layer")


@pytest.fixture(scope="module")
def real():
    return {kind: build(kind) for kind, _ in LAYOUTS.values()}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_lands_at_real_size(name, real):
    kind, _ = LAYOUTS[name]
    model = real[kind]
    assert load(name) == layout(name, model)  # the file is what the table writes from the model
    reached = check_layout(load(name), model)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set().union(*reached.values()) == linears
    fused = {k for k, v in reached.items() if len(v) > 1}
    assert len(fused) == 2 + 2 + (26 if kind == "lumina2" else 30)
    assert all(k.endswith(("attention.qkv", "attention_qkv")) for k in fused)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_table_is_the_single_file_converters_map(name, real):
    from diffusers.loaders.single_file_utils import (
        convert_lumina2_to_diffusers,
        convert_z_image_transformer_checkpoint_to_diffusers,
    )

    kind, family = LAYOUTS[name]
    convert = {"lumina2": convert_lumina2_to_diffusers,
               "z_image": convert_z_image_transformer_checkpoint_to_diffusers}[kind]
    names = ModelNames.of(real[kind])
    checkpoint, tags = tagged_checkpoint(names, family.__wrapped__(names))
    if kind == "z_image":
        checkpoint = {f"model.diffusion_model.{k}": v for k, v in checkpoint.items()}
    # (diffusers' Lumina2 converter fails on the ComfyUI prefix it strips: it renames the keys,
    # then pops them by their old names)
    converted = convert(checkpoint)
    assert set(converted) == set(names.shapes)  # every parameter has an original counterpart
    for param, value in converted.items():
        assert torch.equal(value, tags(param)), param


@pytest.mark.parametrize("alone", [False, True], ids=["all families", "this table alone"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_rows_land_where_diffusers_puts_them(name, alone, real):
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_lumina2_lora_to_diffusers,
        _convert_non_diffusers_z_image_lora_to_diffusers,
    )

    kind, family = LAYOUTS[name]
    sd, modules = tagged(load(name))
    with only(family if alone else None):
        got, unmatched = shuttle_rows(sd, modules, real[kind])
    assert unmatched == {}
    model_modules = dict(real[kind].named_modules())
    if kind == "lumina2":  # its converter raises on keys outside the blocks
        outside = {k: v for k, v in sd.items() if k.split(".")[1] in _OUTSIDE_BLOCKS}
        with pytest.raises(ValueError, match="should be empty"):
            _convert_non_diffusers_lumina2_lora_to_diffusers(dict(sd))
        converted = _convert_non_diffusers_lumina2_lora_to_diffusers(
            {k: v for k, v in sd.items() if k not in outside})
        assert len(outside) == 2 * 6
    else:
        converted = _convert_non_diffusers_z_image_lora_to_diffusers(dict(sd))
    want = converted_rows(converted, modules)
    # diffusers' Z-Image converter leaves x_embedder/final_layer on names the model lacks
    lost = {k for k in want if k not in model_modules}
    if kind == "z_image":
        assert lost == {"x.embedder", "final.layer.linear", "final.layer.adaLN_modulation.1"}
        for new, old in {"all_x_embedder.2-1": "x.embedder",
                         "all_final_layer.2-1.linear": "final.layer.linear",
                         "all_final_layer.2-1.adaLN_modulation.1":
                         "final.layer.adaLN_modulation.1"}.items():
            assert got.pop(new) == want.pop(old)
    else:
        assert lost == set()
        got = {k: v for k, v in got.items() if k.startswith(("noise_refiner.", "context_refiner.",
                                                             "layers."))}
    assert got == want


def _randn_lora(layers: dict, style: str, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g) if s != [] else torch.tensor(float(2 + i % 5))
            for i, (k, s) in enumerate(lora_keys(layers, style).items())}


def tiny_lumina2() -> torch.nn.Module:
    """Grouped key/value heads (4 query heads, 2 key/value heads of 8), as the real model."""
    torch.manual_seed(0)
    model = diffusers.Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2,
        num_refiner_layers=1, num_attention_heads=4, num_kv_heads=2, multiple_of=16,
        cap_feat_dim=16, axes_dim_rope=(2, 2, 4), axes_lens=(8, 8, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def test_tiny_lumina2_merge_equals_diffusers_load_and_fuse():
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

    base = tiny_lumina2()
    layers = original_layers(base, lumina2_names.__wrapped__)
    sd = _randn_lora(layers, "peft:diffusion_model.")
    qkv = {k: v for k, v in sd.items() if ".attention.qkv." in k}
    assert len(qkv) == 2 * 4

    converted = convert_lumina2_to_diffusers(  # renames, as for the checkpoint
        {k.removeprefix("diffusion_model."): v.clone() for k, v in sd.items() if k not in qkv})
    expected = fused_by_diffusers(base, converted, 0.7, prefix=None)
    params = dict(expected.named_parameters())
    with torch.no_grad():  # q: 4 heads x 8 rows, then k and v: 2 heads x 8 rows each
        for key, down in qkv.items():
            if ".lora_A." not in key:
                continue
            block = key.removeprefix("diffusion_model.").split(".attention.")[0]
            delta = qkv[key.replace("lora_A", "lora_B")].double() @ down.double()
            for d, rows in zip(("to_q", "to_k", "to_v"), delta.split([32, 16, 16]), strict=True):
                w = params[f"{block}.attn.{d}.weight"]
                w.copy_((w.double() + 0.7 * rows).float())

    report = merged_like(base, sd, expected, 0.7)
    assert len(report.applied) == sum(isinstance(m, torch.nn.Linear) for m in base.modules())


def tiny_z_image() -> torch.nn.Module:
    torch.manual_seed(0)
    model = diffusers.ZImageTransformer2DModel(
        in_channels=4, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
        cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[16, 8, 8])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def test_tiny_z_image_merge_equals_diffusers_load_and_fuse():
    from diffusers.loaders import ZImageLoraLoaderMixin

    base = tiny_z_image()
    layers = original_layers(base, z_image_names.__wrapped__)
    sd = _randn_lora(layers, "kohya")
    outside = {k: v for k, v in sd.items()
               if k.startswith(("lora_unet_x_embedder.", "lora_unet_final_layer_"))}
    assert len(outside) == 3 * 3

    converted = ZImageLoraLoaderMixin.lora_state_dict(
        {k: v.clone() for k, v in sd.items() if k not in outside})
    expected = fused_by_diffusers(base, converted, 0.7)
    params = dict(expected.named_parameters())
    places = {"x_embedder": "all_x_embedder.2-1", "final_layer_linear":
              "all_final_layer.2-1.linear", "final_layer_adaLN_modulation_1":
              "all_final_layer.2-1.adaLN_modulation.1"}
    with torch.no_grad():  # kohya: up @ down * alpha / rank
        for original, place in places.items():
            name = f"lora_unet_{original}"
            down, up = outside[f"{name}.lora_down.weight"], outside[f"{name}.lora_up.weight"]
            scale = outside[f"{name}.alpha"].item() / down.shape[0]
            w = params[f"{place}.weight"]
            w.copy_((w.double() + 0.7 * scale * (up.double() @ down.double())).float())

    report = merged_like(base, sd, expected, 0.7)
    assert len(report.applied) == sum(isinstance(m, torch.nn.Linear) for m in base.modules())
