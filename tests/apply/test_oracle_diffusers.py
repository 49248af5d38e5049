"""diffusers LoRA files written by ``save_lora_weights``, run by shuttle, against diffusers.

A tiny Flux pipeline (transformer and CLIP text encoder) and a tiny Stable Diffusion UNet (its
convs too) get PEFT LoRAs (random A and B; ``lora_alpha != r``, rsLoRA, rank/alpha patterns,
DoRA), saved as diffusers' training scripts save them: ``<Pipeline>.save_lora_weights(dir,
transformer_lora_layers=get_peft_model_state_dict(model), transformer_lora_adapter_metadata=
config.to_dict(), ...)``. The oracle is diffusers' own ``load_lora_weights`` then
``fuse_lora(lora_scale=k)``; shuttle loads the same file and runs it at strength ``k``, merged
into a copy of the pipeline's components (compared parameter by parameter with the fused ones)
and dynamic (compared output by output with the fused components' forward).

The transformer is loaded as ``FluxPipeline.load_lora_weights`` loads it,
``transformer.load_lora_adapter(dir, weight_name=..., prefix="transformer")``, which reads the
transformer's config from the header. Text encoder: diffusers loads it through transformers' PEFT
integration, which with the transformers 5 / peft 0.21 here does not load; its oracle is PEFT's
own forward of the adapter that was saved, at ``set_scale("default", k)`` (what
``fuse_lora(lora_scale=k)`` does to it).
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

import shuttle
from tests.apply.oracle_models import MODES, STRENGTHS, randomize
from tests.formats.test_diffusers import (
    FILE,
    FLUX_TARGETS,
    tiny_clip,
    tiny_flux_transformer,
    tiny_unet,
)

pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CONFIGS = {
    "alpha": {"r": 4, "lora_alpha": 12},
    "rslora": {"r": 4, "lora_alpha": 6, "use_rslora": True},
    "patterns": {"r": 4, "lora_alpha": 8,
                 "rank_pattern": {"single_transformer_blocks.0.attn.to_q": 2},
                 "alpha_pattern": {"to_k": 2.0, "^transformer_blocks.1.attn.to_v": 16.0}},
    "dora": {"r": 4, "lora_alpha": 8, "use_dora": True},
}
TE_CONFIG = {"r": 2, "lora_alpha": 1, "target_modules": ["q_proj", "v_proj", "fc1"]}


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def trained(base: nn.Module, seed: int, **config) -> nn.Module:
    """A copy of ``base`` with a PEFT LoRA of random weights (as after training)."""
    from diffusers import ModelMixin

    model = copy.deepcopy(base)
    cfg = peft.LoraConfig(**config)
    if isinstance(model, ModelMixin):
        model.add_adapter(cfg)
    else:
        peft.inject_adapter_in_model(cfg, model)
        model.peft_config = {"default": cfg}
    randomize(((n, p) for n, p in model.named_parameters() if "lora_" in n), seed=seed)
    return model


def lora_layers(model: nn.Module) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def flux_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"hidden_states": torch.randn(1, 16, 4, generator=g),
            "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
            "pooled_projections": torch.randn(1, 16, generator=g),
            "timestep": torch.tensor([0.5]), "img_ids": torch.randn(16, 3, generator=g),
            "txt_ids": torch.zeros(5, 3), "return_dict": False}


def forward(model: nn.Module) -> torch.Tensor:
    """The output of a tiny Flux transformer, SD UNet or CLIP text encoder on seeded inputs."""
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        if hasattr(model, "x_embedder"):
            return model(**flux_inputs())[0]
        if hasattr(model, "conv_in"):
            return model(torch.randn(1, 4, 8, 8, generator=g), 10,
                         torch.randn(1, 3, 8, generator=g)).sample
        return model(input_ids=torch.tensor([[0, 3, 4, 5, 2]])).last_hidden_state


def close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    atol = 1e-6 * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def assert_same(got: nn.Module, expected: nn.Module, base: nn.Module, mode: str) -> None:
    if mode == "merge":
        exp, base_params = dict(expected.named_parameters()), dict(base.named_parameters())
        params = dict(got.named_parameters())
        assert params.keys() == exp.keys()
        assert any(not torch.equal(exp[n], base_params[n]) for n in exp), "adapter did nothing"
        for n, p in params.items():
            close(p, exp[n], n)
    else:
        e = forward(expected)
        assert not torch.allclose(e, forward(base), rtol=1e-4, atol=1e-4), "adapter did nothing"
        close(forward(got), e, "output")


def shuttle_run(parts: dict[str, nn.Module], path, k: float, mode: str, check) -> None:
    """shuttle's run of the file at strength ``k`` on copies of ``parts``; ``check(parts)``
    inside it (for ``dynamic``, while the adapter is attached).
    """
    pipe = nn.Module()
    for name, m in parts.items():
        setattr(pipe, name, copy.deepcopy(m))
    lora = shuttle.load_lora(path)
    assert lora.format == "diffusers"
    if mode == "merge":
        report = shuttle.merge_lora(pipe, [(lora, k)])
        assert report.unmatched == {} and len(report.applied) == len(lora)
        check(dict(pipe.named_children()))
    else:
        with shuttle.apply_lora(pipe, [(lora, k)], mode="dynamic"):
            check(dict(pipe.named_children()))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", STRENGTHS)
@pytest.mark.parametrize("case", list(CONFIGS))
def test_flux_pipeline(case, k, mode, tmp_path):
    from diffusers import FluxPipeline

    base_tr, base_te = tiny_flux_transformer(), tiny_clip()
    tr = trained(base_tr, 5, target_modules=[*FLUX_TARGETS, "x_embedder"], **CONFIGS[case])
    te = trained(base_te, 6, **TE_CONFIG)
    FluxPipeline.save_lora_weights(
        tmp_path, transformer_lora_layers=lora_layers(tr), text_encoder_lora_layers=lora_layers(te),
        transformer_lora_adapter_metadata=tr.peft_config["default"].to_dict(),
        text_encoder_lora_adapter_metadata=te.peft_config["default"].to_dict())

    fused_tr = copy.deepcopy(base_tr)  # what FluxPipeline.load_lora_weights does to it
    fused_tr.load_lora_adapter(tmp_path, weight_name=FILE, prefix="transformer")
    fused_tr.fuse_lora(lora_scale=k)
    fused_tr.unload_lora()
    for m in te.modules():  # the text encoder's oracle: PEFT at scale k
        if isinstance(m, peft.tuners.lora.LoraLayer):
            m.set_scale("default", k)

    def check(parts):
        assert_same(parts["transformer"], fused_tr, base_tr, mode)
        if mode == "merge":
            te_merged = copy.deepcopy(te)
            for name, m in list(te_merged.named_modules()):
                if isinstance(m, peft.tuners.lora.LoraLayer):
                    m.merge()
                    parent, _, leaf = name.rpartition(".")
                    setattr(te_merged.get_submodule(parent), leaf, m.get_base_layer())
            assert_same(parts["text_encoder"], te_merged, base_te, mode)
        else:
            assert_same(parts["text_encoder"], te, base_te, mode)

    shuttle_run({"transformer": base_tr, "text_encoder": base_te}, tmp_path / FILE, k, mode,
                check)


UNET_TARGETS = ["to_q", "to_out.0", "proj_in", "conv1", "conv_in"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", STRENGTHS)
def test_sd_unet(k, mode, tmp_path):
    from diffusers import StableDiffusionPipeline

    base = tiny_unet().eval()
    unet = trained(base, 7, target_modules=UNET_TARGETS, r=2, lora_alpha=3, use_rslora=True,
                   use_dora=True)
    StableDiffusionPipeline.save_lora_weights(
        tmp_path, unet_lora_layers=lora_layers(unet),
        unet_lora_adapter_metadata=unet.peft_config["default"].to_dict())
    fused = copy.deepcopy(base)  # what StableDiffusionPipeline.load_lora_weights does to it
    fused.load_lora_adapter(tmp_path, weight_name=FILE, prefix="unet")
    fused.fuse_lora(lora_scale=k)
    fused.unload_lora()

    def check(parts):
        assert_same(parts["unet"], fused, base, mode)

    shuttle_run({"unet": base}, tmp_path / FILE, k, mode, check)
