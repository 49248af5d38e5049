"""Resolve published adapter layouts onto FLUX.1-dev built on the meta device.

Adapters come from ``tests/data/real_keys/*.json`` (names and shapes only). Their tensors
are meta tensors (no memory) except the 0-dim alphas, which the loader reads into scales. Every
file its README marks "shapes fit: yes" is resolved onto the model of its naming scheme:
BFL-named ones onto :class:`FluxBFL`, diffusers-named ones onto diffusers'
``FluxTransformer2DModel`` (with CLIP-L and T5-XXL as ``text_encoder``/``text_encoder_2``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import ShapeMismatchError
from shuttle.targets import ModelNames, resolve
from tests.targets.flux_bfl import FluxBFL

REAL_KEYS = Path(__file__).parents[1] / "data/real_keys"

# file -> the model it is resolved onto (fixture names below).
MODEL_OF = {
    "flux-dev-kohya.json": "bfl",
    "flux-dev-kohya-te1.json": "bfl_pipeline",
    "flux-dev-kohya-te1-te3.json": "bfl_pipeline",
    "flux-dev-aitoolkit.json": "bfl",
    "flux-dev-bfl-control.json": "bfl_control",
    "flux-dev-xlabs.json": "bfl",
    "flux-dev-diffusers.json": "diffusers_pipeline",
    "flux-dev-diffusers-no-proj-mlp.json": "diffusers_pipeline",
    "flux-dev-diffusers-norm-out.json": "diffusers_pipeline",
    "flux-dev-peft.json": "diffusers_pipeline",
    "flux-dev-onetrainer-dora.json": "diffusers_pipeline",
    "flux-dev-dora.json": "diffusers_pipeline",
    "qwen-image-diffusers.json": "qwen_image",
}


def shapes_fit_files() -> list[str]:
    """Files whose "shapes fit" column in the README starts with "yes"."""
    out = []
    for line in (REAL_KEYS / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 2 and cells[0].endswith(".json") and cells[-1].startswith("yes"):
            out.append(cells[0])
    return sorted(out)


def meta_state_dict(name: str) -> dict[str, torch.Tensor]:
    """The file's keys as meta tensors, with real 0-dim alphas (the loader reads those)."""
    keys = json.loads((REAL_KEYS / name).read_text())
    return {k: torch.tensor(16.0) if s == [] else torch.empty(s, dtype=torch.bfloat16,
                                                               device="meta")
            for k, s in keys.items()}


def _pipeline(**components: nn.Module) -> nn.Module:
    m = nn.Module()
    for k, v in components.items():
        setattr(m, k, v)
    return m


@pytest.fixture(scope="module")
def text_encoders():
    transformers = pytest.importorskip("transformers")
    clip_cfg = transformers.CLIPTextConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
    t5_cfg = transformers.T5Config(d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64,
                                   feed_forward_proj="gated-gelu")  # T5 v1.1 XXL: wi_0, wi_1
    with torch.device("meta"):
        return (transformers.CLIPTextModel(clip_cfg), transformers.T5EncoderModel(t5_cfg))


@pytest.fixture(scope="module")
def models(text_encoders):
    """Lazily built models by name (each on the meta device)."""
    clip, t5 = text_encoders
    built: dict[str, nn.Module] = {}

    def build(kind: str) -> nn.Module:
        if kind in built:
            return built[kind]
        with torch.device("meta"):
            if kind == "bfl":
                m = FluxBFL()
            elif kind == "bfl_control":
                m = FluxBFL(in_channels=128)
            elif kind == "bfl_pipeline":
                m = _pipeline(diffusion_model=FluxBFL(), text_encoder=clip, text_encoder_2=t5)
            elif kind == "diffusers_pipeline":
                diffusers = pytest.importorskip("diffusers")
                # FLUX.1-dev's config is the default one plus the guidance embedder.
                flux = diffusers.FluxTransformer2DModel(guidance_embeds=True)
                m = _pipeline(transformer=flux, text_encoder=clip, text_encoder_2=t5)
            elif kind == "qwen_image":
                diffusers = pytest.importorskip("diffusers")
                m = diffusers.QwenImageTransformer2DModel()
            else:
                raise KeyError(kind)
        built[kind] = m
        return m

    return build


def test_model_table_matches_readme():
    assert set(MODEL_OF) == set(shapes_fit_files())


def test_bfl_skeleton_matches_layouts():
    """The skeleton's shapes are the ones the BFL-named reference files imply."""
    with torch.device("meta"):
        shapes = ModelNames.of(FluxBFL()).shapes
    assert sum(s.numel() for s in shapes.values()) == pytest.approx(11.9e9, rel=0.01)
    aitoolkit = json.loads((REAL_KEYS / "flux-dev-aitoolkit.json").read_text())
    for key, shape in aitoolkit.items():
        module = key.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0]
        w = shapes[f"{module}.weight"]
        assert shape[0 if ".lora_A." in key else 1] == 16
        assert shape[1 if ".lora_A." in key else 0] == (w[1] if ".lora_A." in key else w[0])
    control = json.loads((REAL_KEYS / "flux-dev-bfl-control.json").read_text())
    for key, shape in control.items():
        if key.endswith("_norm.scale"):
            assert shapes[key] == torch.Size(shape)
        elif key.endswith("lora_B.bias"):
            assert shapes[key.replace(".lora_B.bias", ".bias")] == torch.Size(shape)


def _check_resolution(lora: shuttle.LoRA, model: nn.Module):
    res = resolve(lora, model)
    assert res.unmatched == {}
    shapes = ModelNames.of(model).shapes
    layers: dict[str, set[str]] = defaultdict(set)
    per_patch: dict[tuple[str, str], int] = defaultdict(int)
    for t in res.targets:
        shape = shapes[t.param]
        if t.rows is not None:
            start, end = t.rows
            assert 0 <= start < end <= shape[0]
            shape = torch.Size((end - start, *shape[1:]))
        t.patch.check(shape, t.param)  # implied (in, out) == the layer's
        layers[t.module_key].add(t.param.rsplit(".", 1)[0])
        per_patch[(t.module_key, t.patch.param)] += 1
    # Every module lands on exactly one layer, every patch on exactly one parameter.
    assert set(layers) == set(lora.modules)
    assert all(len(v) == 1 for v in layers.values()), {k: v for k, v in layers.items()
                                                        if len(v) > 1}
    assert all(n == 1 for n in per_patch.values())
    assert len(res.targets) == sum(len(ps) for ps in lora.modules.values())
    return res, {k: next(iter(v)) for k, v in layers.items()}


@pytest.mark.parametrize("name", shapes_fit_files())
def test_resolve_real_layout(name, models):
    lora = shuttle.load_lora(meta_state_dict(name))
    model = models(MODEL_OF[name])
    _, layer_of = _check_resolution(lora, model)

    # Keys land in the component their prefix names.
    for module, layer in layer_of.items():
        if module.startswith("lora_te1_"):
            # CLIP-L (transformers 5 has no ``text_model.`` level; 4.x has it)
            assert layer.startswith("text_encoder.") and ".encoder.layers." in layer
        elif module.startswith(("lora_te2_", "lora_te3_")):
            assert layer.startswith("text_encoder_2.encoder.block.")  # T5-XXL
        elif MODEL_OF[name] == "bfl_pipeline":
            assert layer.startswith("diffusion_model.")
        elif MODEL_OF[name] == "diffusers_pipeline":
            assert layer.startswith("transformer.")


def test_xlabs_streams_onto_bfl_attention(models):
    lora = shuttle.load_lora(meta_state_dict("flux-dev-xlabs.json"))
    _, layer_of = _check_resolution(lora, models("bfl"))
    assert layer_of["double_blocks.10.img_attn.qkv"] == "double_blocks.10.img_attn.qkv"
    assert layer_of["double_blocks.1.txt_attn.proj"] == "double_blocks.1.txt_attn.proj"


def test_control_lora_bias_and_norm_scales(models):
    lora = shuttle.load_lora(meta_state_dict("flux-dev-bfl-control.json"))
    res, _ = _check_resolution(lora, models("bfl_control"))
    kinds = defaultdict(set)
    for t in res.targets:
        kinds[t.patch.kind].add(t.param.rsplit(".", 1)[1])
    assert kinds == {"lora": {"weight"}, "diff": {"bias"}, "set": {"scale"}}
    assert sum(t.patch.kind == "set" for t in res.targets) == 152
    # On the 64-channel model the widened img_in does not fit, and check() says so.
    img_in = next(t for t in resolve(lora, models("bfl")).targets if t.param == "img_in.weight")
    with pytest.raises(ShapeMismatchError):
        img_in.patch.check(torch.Size((3072, 64)), img_in.param)


def test_te3_prefix_lands_on_t5(models):
    lora = shuttle.load_lora(meta_state_dict("flux-dev-kohya-te1-te3.json"))
    _, layer_of = _check_resolution(lora, models("bfl_pipeline"))
    assert layer_of["lora_te3_encoder_block_0_layer_1_DenseReluDense_wi_0"] == (
        "text_encoder_2.encoder.block.0.layer.1.DenseReluDense.wi_0")
    assert layer_of["lora_te1_text_model_encoder_layers_0_self_attn_q_proj"].endswith(
        "encoder.layers.0.self_attn.q_proj")


def _check_cross_layout(lora, model) -> None:
    """Every module placed (possibly split over several layers) and every piece fits."""
    res = resolve(lora, model)
    assert res.unmatched == {}
    shapes = ModelNames.of(model).shapes
    placed = set()
    for t in res.targets:
        shape = shapes[t.param]
        if t.rows is not None:
            shape = (t.rows[1] - t.rows[0], *shape[1:])
        t.patch.check(shape, t.param)
        placed.add(t.module_key)
    assert placed == set(lora.modules)


@pytest.mark.parametrize("name", ["flux-dev-diffusers.json", "flux-dev-peft.json",
                                  "flux-dev-dora.json", "flux-dev-diffusers-norm-out.json"])
def test_diffusers_names_on_bfl_model_through_the_flux_table(name, models):
    """diffusers-named adapters land on rows of the BFL model's fused layers (to_q -> rows of
    img_attn.qkv, proj_mlp -> rows of linear1, norm_out halves swapped, ...)."""
    _check_cross_layout(shuttle.load_lora(meta_state_dict(name)), models("bfl"))


@pytest.mark.parametrize("name", ["flux-dev-kohya.json", "flux-dev-aitoolkit.json",
                                  "flux-dev-xlabs.json"])
def test_bfl_names_on_diffusers_model_through_the_flux_table(name, models):
    """BFL-named adapters split their fused qkv / linear1 updates over diffusers' layers."""
    lora = shuttle.load_lora(meta_state_dict(name))
    _check_cross_layout(lora, models("diffusers_pipeline"))


def test_lokr_sample_names_resolve_but_shapes_do_not_fit(models):
    """flux-dev-lokr is a hand-written sample whose kron products are not the layer sizes."""
    lora = shuttle.load_lora(meta_state_dict("flux-dev-lokr.json"))
    res = resolve(lora, models("bfl"))
    assert res.unmatched == {}
    shapes = ModelNames.of(models("bfl")).shapes
    proj = next(t for t in res.targets if t.param == "double_blocks.0.img_attn.proj.weight")
    with pytest.raises(ShapeMismatchError):
        proj.patch.check(shapes[proj.param], proj.param)
