"""SD3 / SD3.5 adapters in Stability's MMDiT names on diffusers' SD3Transformer2DModel.

Oracle, which does not read shuttle's table: diffusers' single-file converter
``convert_sd3_transformer_checkpoint_to_diffusers`` (fused qkv chunked by thirds, the pre-only
context modulation and the final adaLN halves swapped). diffusers 0.42.1 has no LoRA converter
for these names, so
- at real size (SD3 Medium, SD3.5 Large, SD3.5 Medium's MMDiT-X), every original parameter
  holds, row by row, tags naming the diffusers parameter and row shuttle's table sends it to,
  and the converter must hand each diffusers parameter exactly its own tags;
- on a tiny model, the float64 update of every adapter module, laid out in the original names
  and converted by that converter, added to the weights, equals shuttle's merge.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable

import pytest
import torch

import shuttle
from shuttle.targets import ModelNames, Split
from shuttle.targets.sd3 import sd3_names
from tests.targets.family_layouts import load, lora_keys, original_layers
from tests.targets.family_layouts_mmdit import FILES, build, layout
from tests.targets.family_oracle import check_layout, only

diffusers = pytest.importorskip("diffusers")
logging.getLogger("diffusers").setLevel(logging.ERROR)

LAYOUTS = ("sd3-medium-kohya.json", "sd35-large-kohya.json", "sd35-medium-all-layers.json")
LAYERS = (torch.nn.Linear, torch.nn.Conv2d)


@pytest.fixture(scope="module")
def real():
    return {kind: build(kind) for kind in ("sd3_medium", "sd35_large", "sd35_medium")}


@pytest.mark.parametrize("alone", [False, True], ids=["all families", "this table alone"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_lands_at_real_size(name, alone, real):
    model = real[FILES[name][0]]
    assert load(name) == layout(name, model)  # the file is what the table writes from the model
    with only(sd3_names if alone else None):
        reached = check_layout(load(name), model)
    layers = {n for n, m in model.named_modules() if isinstance(m, LAYERS)}
    if "kohya" in name:  # sd-scripts trains the joint blocks' Linears
        layers = {n for n in layers if n.startswith("transformer_blocks.")}
    assert set().union(*reached.values()) == layers
    fused = {re.sub(r"^(lora_unet_|diffusion_model\.)joint_blocks[._]\d+[._]", "", k)
             for k, v in reached.items() if len(v) > 1}
    assert fused == ({"x_block_attn_qkv", "context_block_attn_qkv"} if "kohya" in name else {
        "x_block.attn.qkv", "context_block.attn.qkv", "x_block.attn2.qkv"})


def _checkpoint(names: ModelNames, rows: Callable[[str], torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    """The original checkpoint (``model.diffusion_model.`` keys) whose rows are ``rows(param)``
    of the diffusers rows the table sends them to.
    """
    checkpoint = {}
    for original, place in sd3_names.__wrapped__(names).items():
        splits = [Split(place)] if isinstance(place, str) else place
        for leaf in names.modules[splits[0].path]:
            first = rows(f"{splits[0].path}.{leaf}")
            height = max(s.source_rows[1] if s.source_rows else first.shape[0] for s in splits)
            value = torch.full((height, *first.shape[1:]), -1.0, dtype=torch.float64)
            for s in splits:
                a, b = s.source_rows or (0, height)
                value[a:b] = rows(f"{s.path}.{leaf}")[slice(*s.rows) if s.rows else slice(None)]
            checkpoint[f"model.diffusion_model.{original}.{leaf}"] = value
    return checkpoint


@pytest.mark.parametrize("kind", ["sd3_medium", "sd35_large", "sd35_medium"])
def test_table_is_the_single_file_converters_map(kind, real):
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    names = ModelNames.of(real[kind])
    index = {p: i for i, p in enumerate(names.shapes)}

    def tags(param: str) -> torch.Tensor:  # row j of diffusers parameter number i
        return torch.arange(names.shapes[param][0], dtype=torch.float64) + index[param] * 2**20

    checkpoint = _checkpoint(names, tags)
    checkpoint["model.diffusion_model.pos_embed"] = torch.zeros(1)  # a buffer, not a target
    converted = convert_sd3_transformer_checkpoint_to_diffusers(checkpoint)
    assert checkpoint == {}  # the converter took every original parameter
    del converted["pos_embed.pos_embed"]
    assert set(converted) == set(names.shapes)  # none left without its original
    for param, value in converted.items():
        assert torch.equal(value, tags(param)), param


def tiny_sd35() -> torch.nn.Module:
    """SD3.5 Medium's layout at toy widths: qk norms, a dual-attention block, a pre-only last
    block."""
    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=12, caption_projection_dim=16,
        pooled_projection_dim=10, out_channels=4, pos_embed_max_size=8, qk_norm="rms_norm",
        dual_attention_layers=(0,))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("style", ["diffusion_model", "kohya"])
def test_tiny_merge_equals_the_converted_float64_update(style):
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    base = tiny_sd35()
    names = ModelNames.of(base)
    layers = original_layers(base, sd3_names.__wrapped__)
    g = torch.Generator().manual_seed(1)
    sd = {}
    for i, (key, shape) in enumerate(lora_keys(layers, style).items()):
        sd[key] = torch.randn(*shape, generator=g) if shape else torch.tensor(float(1 + i % 5))

    # The original checkpoint of the updates: zeros, with 0.7 * alpha / r * up @ down in each
    # adapted weight (in float64), then diffusers' conversion.
    prefix = "lora_unet_" if style == "kohya" else "diffusion_model."
    checkpoint = _checkpoint(names, lambda p: torch.zeros(names.shapes[p], dtype=torch.float64))
    for original, (fan_in, fan_out, kernel) in layers.items():
        key = prefix + (original.replace(".", "_") if style == "kohya" else original)
        down, up = sd[f"{key}.lora_down.weight"].double(), sd[f"{key}.lora_up.weight"].double()
        scale = 0.7 * sd[f"{key}.alpha"].item() / down.shape[0]
        delta = (up.flatten(1) @ down.flatten(1)).reshape(fan_out, fan_in, *kernel)
        checkpoint[f"model.diffusion_model.{original}.weight"] += scale * delta
    checkpoint["model.diffusion_model.pos_embed"] = torch.zeros(1)
    update = convert_sd3_transformer_checkpoint_to_diffusers(checkpoint)

    got = copy.deepcopy(base)
    report = shuttle.merge_lora(got, [(sd, 0.7)])
    assert report.unmatched == {}
    assert len(report.applied) == sum(isinstance(m, LAYERS) for m in base.modules())
    for name, p in got.named_parameters():
        want = (dict(base.named_parameters())[name].double() + update[name]).float()
        torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-5, msg=name)
