"""diffusers LoRA files with the PEFT config in the safetensors header (``lora_adapter_metadata``).

Oracle: the libraries themselves, float32 throughout. A tiny diffusers model gets a PEFT LoRA
(``init_lora_weights=False``: A and B non-zero) whose scale is not 1: ``lora_alpha != r``,
rsLoRA, and ``rank_pattern``/``alpha_pattern``. It is saved as diffusers' training scripts save
it, ``<Pipeline>.save_lora_weights(dir, transformer_lora_layers=get_peft_model_state_dict(model),
transformer_lora_adapter_metadata=model.peft_config["default"].to_dict())``, which writes each
component's config with its fields prefixed (``"transformer.lora_alpha"``); or with the model's
own ``save_lora_adapter`` (flat fields). diffusers' own load of that file (``load_lora_weights``
or ``load_lora_adapter``, both build the LoraConfig from the metadata), then ``fuse_lora``, gives
the expected weights; shuttle merges the same file into a fresh copy of the base model.

Text encoders: diffusers loads them through transformers' PEFT integration, which in
transformers 5 needs peft >= 0.22; with the peft here the expected weights are PEFT's own merge
of the adapter that was saved (what diffusers' load would build from the same config).
"""

from __future__ import annotations

import copy
import json
import logging
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import shuttle
from shuttle.errors import CorruptFileError

pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOL = {"rtol": 1e-6, "atol": 1e-6}
FILE = "pytorch_lora_weights.safetensors"
FLUX_TARGETS = ["to_q", "to_k", "to_v", "proj_mlp", "ff.net.2"]

# Each config's scale differs from 1 on every layer it adapts (a file read at scale 1 fails).
CONFIGS = {
    "alpha": {"r": 4, "lora_alpha": 12},
    "rslora": {"r": 4, "lora_alpha": 6, "use_rslora": True},
    # PEFT matches pattern keys as regexes `(.*\.)?(key)$` on the names inside the model it
    # adapted; "^" anchors at that model's root (the transformer's, not the pipeline's).
    "patterns": {"r": 4, "lora_alpha": 8,
                 "rank_pattern": {"single_transformer_blocks.0.attn.to_q": 2},
                 "alpha_pattern": {"to_k": 2.0, "^transformer_blocks.1.attn.to_v": 16.0}},
}


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def tiny_flux_transformer() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
        axes_dims_rope=[2, 2, 4]).eval()


def tiny_clip() -> nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(1)
    return CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, hidden_size=16, intermediate_size=24,
        num_attention_heads=2, num_hidden_layers=2, vocab_size=16, projection_dim=16)).eval()


def tiny_unet() -> nn.Module:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(4)
    return UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8,
        norm_num_groups=2, attention_head_dim=2)


def trained(base: nn.Module, **config) -> nn.Module:
    """A copy of ``base`` with a PEFT LoRA of non-zero A and B (as after training)."""
    from diffusers import ModelMixin

    model = copy.deepcopy(base)
    cfg = peft.LoraConfig(init_lora_weights=False, **config)
    if isinstance(model, ModelMixin):
        model.add_adapter(cfg)
    else:  # transformers' add_adapter wants a newer peft: PEFT's own injection
        peft.inject_adapter_in_model(cfg, model)
        model.peft_config = {"default": cfg}
    return model


def lora_layers(model: nn.Module) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def metadata(model: nn.Module) -> dict:
    return model.peft_config["default"].to_dict()


def peft_merged(model: nn.Module) -> nn.Module:
    """PEFT's merge of ``model``'s adapter, the adapter layers removed."""
    merged = copy.deepcopy(model)
    for name, module in list(merged.named_modules()):
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.merge()
            parent, _, leaf = name.rpartition(".")
            setattr(merged.get_submodule(parent), leaf, module.get_base_layer())
    return merged


def shuttle_merged(parts: dict[str, nn.Module], path) -> tuple[dict[str, nn.Module], object]:
    """shuttle's merge of the file at ``path`` into fresh copies of the pipeline's components."""
    fresh = {name: copy.deepcopy(m) for name, m in parts.items()}
    pipe = nn.Module()
    for name, m in fresh.items():
        setattr(pipe, name, m)
    report = shuttle.merge_lora(pipe, [(shuttle.load_lora(path), 1.0)])
    return fresh, report


def assert_same_merge(got: nn.Module, expected: nn.Module, base: nn.Module) -> None:
    exp, base_params = dict(expected.named_parameters()), dict(base.named_parameters())
    params = dict(got.named_parameters())
    assert params.keys() == exp.keys()
    assert any(not torch.equal(exp[n], base_params[n]) for n in exp), "the adapter did nothing"
    for n, p in params.items():
        torch.testing.assert_close(p, exp[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_flux_pipeline_file_matches_diffusers_load(case, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    base = tiny_flux_transformer()
    model = trained(base, target_modules=FLUX_TARGETS, **CONFIGS[case])
    FluxPipeline.save_lora_weights(tmp_path, transformer_lora_layers=lora_layers(model),
                                   transformer_lora_adapter_metadata=metadata(model))

    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
                        text_encoder=None, tokenizer=None, text_encoder_2=None,
                        tokenizer_2=None, transformer=copy.deepcopy(base))
    pipe.load_lora_weights(tmp_path)
    pipe.fuse_lora()
    pipe.unload_lora_weights()

    lora = shuttle.load_lora(tmp_path / FILE)
    assert lora.format == "diffusers" and lora.config is None
    assert set(lora.component_configs) == {"transformer"}
    got, report = shuttle_merged({"transformer": base}, tmp_path / FILE)
    assert report.unmatched == {} and len(report.applied) == len(lora)
    assert_same_merge(got["transformer"], pipe.transformer, base)


def test_each_component_takes_its_own_config(tmp_path):
    """transformer and text encoder in one file, each with its alpha/r (12/4 and 1/2)."""
    from diffusers import FluxPipeline

    base_tr, base_te = tiny_flux_transformer(), tiny_clip()
    tr = trained(base_tr, target_modules=FLUX_TARGETS, **CONFIGS["patterns"])
    te = trained(base_te, r=2, lora_alpha=1, target_modules=["q_proj", "v_proj", "fc1"])
    FluxPipeline.save_lora_weights(
        tmp_path, transformer_lora_layers=lora_layers(tr), text_encoder_lora_layers=lora_layers(te),
        transformer_lora_adapter_metadata=metadata(tr),
        text_encoder_lora_adapter_metadata=metadata(te))

    expected_tr = copy.deepcopy(base_tr)
    expected_tr.load_lora_adapter(tmp_path, weight_name=FILE, prefix="transformer")
    expected_tr.fuse_lora()
    expected_tr.unload_lora()

    lora = shuttle.load_lora(tmp_path / FILE)
    assert {n: (c.r, c.alpha) for n, c in lora.component_configs.items()} == {
        "transformer": (4, 8.0), "text_encoder": (2, 1.0)}
    got, report = shuttle_merged({"transformer": base_tr, "text_encoder": base_te},
                                 tmp_path / FILE)
    assert report.unmatched == {} and len(report.applied) == len(lora)
    assert_same_merge(got["transformer"], expected_tr, base_tr)
    assert_same_merge(got["text_encoder"], peft_merged(te), base_te)


def test_unet_component(tmp_path):
    from diffusers import StableDiffusionPipeline

    base = tiny_unet()
    model = trained(base, r=4, lora_alpha=2, use_rslora=True,
                    target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1", "proj_in"])
    StableDiffusionPipeline.save_lora_weights(tmp_path, unet_lora_layers=lora_layers(model),
                                              unet_lora_adapter_metadata=metadata(model))
    expected = copy.deepcopy(base)
    expected.load_lora_adapter(tmp_path, weight_name=FILE, prefix="unet")
    expected.fuse_lora()
    expected.unload_lora()

    assert set(shuttle.load_lora(tmp_path / FILE).component_configs) == {"unet"}
    got, report = shuttle_merged({"unet": base}, tmp_path / FILE)
    assert report.unmatched == {}
    assert_same_merge(got["unet"], expected, base)


def test_model_file_with_flat_metadata(tmp_path):
    """A model's own ``save_lora_adapter``: unprefixed keys and fields."""
    base = tiny_flux_transformer()
    model = trained(base, target_modules=FLUX_TARGETS, **CONFIGS["patterns"])
    model.save_lora_adapter(tmp_path)
    expected = copy.deepcopy(base)
    expected.load_lora_adapter(tmp_path, weight_name=FILE, prefix=None)
    expected.fuse_lora()
    expected.unload_lora()

    lora = shuttle.load_lora(tmp_path / FILE)
    assert lora.format == "peft" and lora.component_configs == {}
    assert lora.config is not None and lora.config.alpha == 8.0
    got = copy.deepcopy(base)
    assert shuttle.merge_lora(got, lora).unmatched == {}
    assert_same_merge(got, expected, base)


# -- without the libraries: how the header is read ------------------------------------------

def _file(tmp_path, entry: str):
    path = tmp_path / "a.safetensors"
    save_file({"transformer.x.lora_A.weight": torch.ones(4, 6),
               "transformer.x.lora_B.weight": torch.ones(8, 4),
               "unet.y.lora_A.weight": torch.ones(2, 6),
               "unet.y.lora_B.weight": torch.ones(8, 2)}, str(path),
              metadata={"lora_adapter_metadata": entry})
    return path


def _scales(lora) -> dict[str, float]:
    return {m: ps[0].scale for m, ps in lora.modules.items()}


def test_components_by_prefix_and_explicit_config_overrides_them(tmp_path):
    path = _file(tmp_path, json.dumps({
        "transformer.r": 4, "transformer.lora_alpha": 2,
        "transformer.alpha_pattern": {"^x": 6}, "unet.r": 2, "unet.lora_alpha": 8}))
    assert _scales(shuttle.load_lora(path)) == {"transformer.x": 1.5, "unet.y": 4.0}
    lora = shuttle.load_lora(path, config={"r": 2, "lora_alpha": 1})
    assert lora.component_configs == {}
    assert _scales(lora) == {"transformer.x": 0.25, "unet.y": 0.5}


def test_module_of_a_component_without_config_keeps_scale_one(tmp_path):
    path = _file(tmp_path, json.dumps({"unet.r": 2, "unet.lora_alpha": 8}))
    assert _scales(shuttle.load_lora(path)) == {"transformer.x": 1.0, "unet.y": 4.0}


@pytest.mark.parametrize("entry", ["{not json", "[1, 2]"])
def test_unreadable_metadata_is_an_error(tmp_path, entry):
    with pytest.raises(CorruptFileError, match="lora_adapter_metadata"):
        shuttle.load_lora(_file(tmp_path, entry))
