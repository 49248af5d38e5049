"""LTX-Video adapters in Lightricks' original names on diffusers' LTXVideoTransformer3DModel.

Oracles, none of which reads shuttle's table:
- diffusers' single-file converter ``convert_ltx_transformer_checkpoint_to_diffusers`` passes
  values through, so a checkpoint in original names whose values are their diffusers names
  comes back as the identity, at real size (LTX-Video 0.9.7 13B);
- diffusers' LoRA converter ``_convert_non_diffusers_ltxv_lora_to_diffusers`` on the real-size
  layout, row for row, for the keys it places (it only strips ``diffusion_model.``, so
  ``patchify_proj``/``adaln_single`` keys come out on layers the model lacks);
- on a tiny model, diffusers' own load + ``fuse_lora`` of the file with the single-file
  converter's renames applied to its keys first (which places those layers too).
"""

from __future__ import annotations

import logging

import pytest
import torch

from shuttle.targets import ModelNames
from shuttle.targets.ltx_video import ltx_video_names
from tests.targets.family_layouts import load, lora_keys, original_layers
from tests.targets.family_oracle import (
    check_layout,
    converted_rows,
    fused_by_diffusers,
    merged_like,
    only,
    shuttle_rows,
    tagged,
)
from tests.targets.ltx_lumina_layouts import build, layout

diffusers = pytest.importorskip("diffusers")
logging.getLogger("diffusers").setLevel(logging.ERROR)

NAME = "ltxv-13b-diffusion-model.json"
_RENAMED = ("patchify_proj", "adaln_single")  # where the LoRA converter and the model differ


@pytest.fixture(scope="module")
def model():
    return build("ltxv_13b")


def test_layout_lands_at_real_size(model):
    assert load(NAME) == layout(NAME, model)  # the file is what the table writes from the model
    reached = check_layout(load(NAME), model)
    assert all(len(v) == 1 for v in reached.values())
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set().union(*reached.values()) == linears and len(linears) == 48 * 10 + 7


def test_table_is_the_single_file_converters_map(model):
    from diffusers.loaders.single_file_utils import (
        convert_ltx_transformer_checkpoint_to_diffusers,
    )

    names = ModelNames.of(model)
    original_of = {place: o for o, place in ltx_video_names.__wrapped__(names).items()}
    checkpoint = {}
    for param in names.shapes:
        module, _, leaf = param.rpartition(".")
        original = original_of[param] if param in original_of else f"{original_of[module]}.{leaf}"
        checkpoint[f"model.diffusion_model.{original}"] = param
    # the original names (not the identity a table without renames would give)
    assert all(any(f".{o}." in k for k in checkpoint)
               for o in ("patchify_proj", "adaln_single", "q_norm", "k_norm"))
    assert convert_ltx_transformer_checkpoint_to_diffusers(checkpoint) == {
        p: p for p in names.shapes}


@pytest.mark.parametrize("alone", [False, True], ids=["all families", "this table alone"])
def test_rows_land_where_diffusers_puts_them(alone, model):
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_ltxv_lora_to_diffusers,
    )

    sd, modules = tagged(load(NAME))
    with only(ltx_video_names if alone else None):
        got, unmatched = shuttle_rows(sd, modules, model)
    assert unmatched == {}
    want = converted_rows(_convert_non_diffusers_ltxv_lora_to_diffusers(dict(sd)), modules)
    # diffusers' converter keeps the original names of the four layers it should rename
    lost = {k for k in want if k.startswith(_RENAMED)}
    assert len(lost) == 4 and not any(k in dict(model.named_modules()) for k in lost)
    renamed = {"proj_in": "patchify_proj", "time_embed.emb.timestep_embedder.linear_1":
               "adaln_single.emb.timestep_embedder.linear_1",
               "time_embed.emb.timestep_embedder.linear_2":
               "adaln_single.emb.timestep_embedder.linear_2",
               "time_embed.linear": "adaln_single.linear"}
    for new, old in renamed.items():
        assert got.pop(new) == want.pop(old)
    assert got == want


def tiny_ltx() -> torch.nn.Module:
    torch.manual_seed(0)
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=2, caption_channels=12)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def test_tiny_merge_equals_diffusers_load_and_fuse():
    from diffusers.loaders import LTXVideoLoraLoaderMixin
    from diffusers.loaders.single_file_utils import (
        convert_ltx_transformer_checkpoint_to_diffusers,
    )

    base = tiny_ltx()
    layers = original_layers(base, ltx_video_names.__wrapped__)
    assert sum(k.startswith(_RENAMED) for k in layers) == 4
    g = torch.Generator().manual_seed(1)
    sd = {k: torch.randn(*s, generator=g)
          for k, s in lora_keys(layers, "peft:diffusion_model.").items()}

    renamed = convert_ltx_transformer_checkpoint_to_diffusers(
        {k: v.clone() for k, v in sd.items()})
    converted = LTXVideoLoraLoaderMixin.lora_state_dict(renamed)
    expected = fused_by_diffusers(base, converted, 0.7)

    report = merged_like(base, sd, expected, 0.7)
    assert len(report.applied) == len(layers)
    assert not torch.equal(dict(expected.named_parameters())["proj_in.weight"],
                           dict(base.named_parameters())["proj_in.weight"])
