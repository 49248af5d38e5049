"""SD 1.x and SDXL adapters in the original LDM names on diffusers' UNet2DConditionModel.

Oracles, none of which reads shuttle's table:
- diffusers' single-file converter ``convert_ldm_unet_checkpoint`` passes values through, so an
  LDM checkpoint whose every value is its own diffusers name must come back as the identity;
- diffusers' kohya SDXL LoRA converter (``_maybe_map_sgm_blocks_to_diffusers`` and
  ``_convert_non_diffusers_lora_to_diffusers``) on the real-size layout, row for row;
- on tiny UNets of both shapes, the merged weights: for SDXL diffusers' own load of the kohya
  file + ``fuse_lora``; for SD 1.x (whose LDM LoRA names diffusers' kohya converter does not
  handle) float64 deltas that the single-file converter routes.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import shuttle
from shuttle.targets import ModelNames
from shuttle.targets.sd_unet import sd_unet_names
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

LAYOUTS = {"sdxl-kohya-ldm.json": "sdxl", "sd15-comfy-ldm.json": "sd15"}


@pytest.fixture(scope="module")
def real():
    return {kind: build(kind) for kind in set(LAYOUTS.values())}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_lands_on_every_layer_at_real_size(name, real):
    model = real[LAYOUTS[name]]
    keys = load(name)
    assert keys == layout(name, model)  # the file is what the table writes from the model
    reached = check_layout(keys, model)
    layers = {n for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)}
    assert all(len(v) == 1 for v in reached.values())
    assert set().union(*reached.values()) == layers  # one LoRA module per layer
    if name.startswith("sd15"):  # the same layout in kohya's spelling lands the same way
        kohya = {_kohya_spelling(k): s for k, s in keys.items()}
        assert set(kohya) != set(keys)
        assert sorted(map(sorted, check_layout(kohya, model).values())) == sorted(
            map(sorted, reached.values()))


def _kohya_spelling(key: str) -> str:
    """``diffusion_model.a.b.lora_up.weight`` -> ``lora_unet_a_b.lora_up.weight``."""
    key = key.removeprefix("diffusion_model.")
    module, sep, rest = key.partition(".lora_")
    if not sep:
        module, rest = key.removesuffix(".alpha"), "alpha"
    return f"lora_unet_{module.replace('.', '_')}.{'lora_' if sep else ''}{rest}"


def test_layout_lands_in_the_unet_of_a_pipeline(real):
    """Under a component root (``unet.``, beside text encoders) the table adds the root."""
    pipe = torch.nn.Module()
    pipe.unet = real["sdxl"]
    with torch.device("meta"):
        pipe.text_encoder = torch.nn.Linear(4, 4)
    reached = check_layout(load("sdxl-kohya-ldm.json"), pipe)
    assert reached["lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"] == {
        "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"}
    assert all(p.startswith("unet.") for v in reached.values() for p in v)


# Parameters of the original checkpoints (v1-5-pruned.safetensors, sd_xl_base_1.0.safetensors,
# without ``model.diffusion_model.``) -> their diffusers names. The Upsample after an
# attention-less level sits at index 1, which diffusers' converter would also take at index 2.
KNOWN = {
    "sd15": {
        "output_blocks.2.1.conv.weight": "up_blocks.0.upsamplers.0.conv.weight",
        "output_blocks.5.2.conv.weight": "up_blocks.1.upsamplers.0.conv.weight",
        "input_blocks.9.0.op.weight": "down_blocks.2.downsamplers.0.conv.weight",
        "input_blocks.11.0.out_layers.3.weight": "down_blocks.3.resnets.1.conv2.weight",
        "middle_block.2.emb_layers.1.weight": "mid_block.resnets.1.time_emb_proj.weight",
        "output_blocks.11.1.transformer_blocks.0.attn2.to_k.weight":
            "up_blocks.3.attentions.2.transformer_blocks.0.attn2.to_k.weight",
        "out.2.weight": "conv_out.weight",
    },
    "sdxl": {
        "output_blocks.2.2.conv.weight": "up_blocks.0.upsamplers.0.conv.weight",
        "input_blocks.6.0.op.weight": "down_blocks.1.downsamplers.0.conv.weight",
        "input_blocks.8.1.transformer_blocks.9.attn2.to_k.weight":
            "down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_k.weight",
        "output_blocks.8.0.skip_connection.weight": "up_blocks.2.resnets.2.conv_shortcut.weight",
        "label_emb.0.0.weight": "add_embedding.linear_1.weight",
        "time_embed.2.weight": "time_embedding.linear_2.weight",
        "input_blocks.0.0.weight": "conv_in.weight",
    },
}


@pytest.mark.parametrize("kind", sorted(KNOWN))
def test_known_checkpoint_names(kind, real):
    names = ModelNames.of(real[kind])
    for ldm, param in KNOWN[kind].items():
        module, leaf = ldm.rsplit(".", 1)
        assert names.param(sd_unet_names(f"diffusion_model.{module}", names), leaf) == param
        assert sd_unet_names("lora_unet_" + module.replace(".", "_"), names) == param[
            :-len(leaf) - 1]


@pytest.mark.parametrize("kind", ["sdxl", "sd15"])
def test_table_is_the_single_file_converters_map(kind, real):
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    model = real[kind]
    names = ModelNames.of(model)
    ldm_of = {place: ldm for ldm, place in sd_unet_names.__wrapped__(names).items()}
    checkpoint = {}
    for param in names.shapes:
        module, leaf = param.rsplit(".", 1)
        checkpoint[f"model.diffusion_model.{ldm_of[module]}.{leaf}"] = param
    converted = convert_ldm_unet_checkpoint(checkpoint, dict(model.config))
    assert converted == {p: p for p in names.shapes}


def test_kohya_sdxl_rows_land_where_diffusers_puts_them(real):
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_lora_to_diffusers,
        _maybe_map_sgm_blocks_to_diffusers,
    )

    model = real["sdxl"]
    sd, modules = tagged(load("sdxl-kohya-ldm.json"))
    got, unmatched = shuttle_rows(sd, modules, model)
    assert unmatched == {}
    ours = dict(sd)
    converted, _ = _convert_non_diffusers_lora_to_diffusers(
        _maybe_map_sgm_blocks_to_diffusers(ours, model.config))
    want = converted_rows(converted, modules)
    # diffusers' legacy attention names: attn1.processor.to_out_lora.up -> attn1.to_out.0
    want = {f"{k}.0" if k.endswith(".to_out") else k: v for k, v in want.items()}
    assert len(want) == len(modules)
    assert got == want


def tiny_unet(kind: str) -> torch.nn.Module:
    """SDXL's or SD 1.x's block structure at toy widths, random weights."""
    common = dict(sample_size=8, norm_num_groups=4, layers_per_block=2, cross_attention_dim=16)
    if kind == "sdxl":
        config = dict(
            common, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D",
                                      "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(8, 16, 32), transformer_layers_per_block=(1, 1, 2),
            attention_head_dim=(2, 2, 4), use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=4,
            projection_class_embeddings_input_dim=16 + 6 * 4)
    else:  # four levels: input_blocks up to 11, an Upsample right after a ResBlock
        config = dict(common, block_out_channels=(8, 8, 16, 16), attention_head_dim=2)
    torch.manual_seed(0)
    model = diffusers.UNet2DConditionModel(**config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def random_lora(model: torch.nn.Module, style: str, varied_alphas: bool = True
                ) -> dict[str, torch.Tensor]:
    """A random LoRA on every Linear and conv of ``model``, in its LDM names.

    Alphas vary per module, or (``varied_alphas=False``) are kohya's two: ``network_alpha``
    for Linears, ``conv_alpha`` for convs.
    """
    g = torch.Generator().manual_seed(1)
    layout = lora_keys(original_layers(model, sd_unet_names.__wrapped__), style)
    sd = {}
    for i, (key, shape) in enumerate(layout.items()):
        if shape == []:
            conv = len(layout[key.replace("alpha", "lora_down.weight")]) > 2
            alpha = 1 + i % 5 if varied_alphas else (2 if conv else 4)
            sd[key] = torch.tensor(float(alpha))
        else:
            sd[key] = torch.randn(*shape, generator=g)
    return sd


def test_tiny_sdxl_merge_equals_diffusers_load_and_fuse():
    from diffusers.loaders import StableDiffusionXLLoraLoaderMixin

    base = tiny_unet("sdxl")
    # diffusers' kohya SDXL loader loses per-module alphas of attention layers (its legacy
    # ``to_q_lora`` names miss its own alpha_pattern; it then uses the most common alpha), so
    # this file has kohya's usual two alphas.
    sd = random_lora(base, "kohya", varied_alphas=False)
    state_dict, alphas = StableDiffusionXLLoraLoaderMixin.lora_state_dict(
        {k: v.clone() for k, v in sd.items()}, unet_config=base.config)
    expected = fused_by_diffusers(base, state_dict, 0.7, prefix="unet", network_alphas=alphas)

    report = merged_like(base, sd, expected, 0.7)
    layers = [n for n, m in base.named_modules()
              if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)]
    assert sorted(report.applied) == sorted(f"{n}.weight" for n in layers)


def test_tiny_sd15_merge_equals_float64_deltas_routed_by_the_single_file_converter():
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    base = tiny_unet("sd15")
    sd = random_lora(base, "diffusion_model")
    shapes = dict((n, p.shape) for n, p in base.named_parameters())
    ldm_shapes = {}  # LDM layer -> shape, from the layout (down: in, k; up: out)
    for key in sd:
        if key.endswith(".lora_down.weight"):
            module = key.removeprefix("diffusion_model.").removesuffix(".lora_down.weight")
            up = sd[key.replace("lora_down", "lora_up")]
            ldm_shapes[module] = (up.shape[0], *sd[key].shape[1:])
    deltas = {}
    for module, shape in ldm_shapes.items():
        name = f"diffusion_model.{module}"
        up = sd[f"{name}.lora_up.weight"].double().flatten(1)
        down = sd[f"{name}.lora_down.weight"].double().flatten(1)
        scale = sd[f"{name}.alpha"].item() / down.shape[0]
        deltas[f"model.diffusion_model.{module}.weight"] = (scale * up @ down).reshape(shape)
        deltas[f"model.diffusion_model.{module}.bias"] = None  # the converter reads some
    routed = convert_ldm_unet_checkpoint(deltas, dict(base.config))
    routed = {k: v for k, v in routed.items() if v is not None}
    assert len(routed) == len(ldm_shapes)

    got = copy.deepcopy(base)
    report = shuttle.merge_lora(got, [(sd, 0.7)])
    assert report.unmatched == {} and sorted(report.applied) == sorted(routed)
    for name, p in got.named_parameters():
        w0 = dict(base.named_parameters())[name].double()
        want = w0 + 0.7 * routed[name].reshape(shapes[name]) if name in routed else w0
        torch.testing.assert_close(p.double(), want, rtol=1e-5, atol=1e-5, msg=name)
