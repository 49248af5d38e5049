"""shuttle.train.accelerate over causal LMs of many transformers architectures, built from their
real config classes, and over diffusers' image and video transformers and UNet (tiny sizes):
every Linear adapted by PEFT, one step, the loss and every gradient those of PEFT's own
forward, and the fused paths each layout allows (a fused MLP where its class is a known gated
MLP, a q/k/v group where the projections are called on one variable; Phi-3's fused
``qkv_proj`` and ``gate_up_proj`` take the per-layer path).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from shuttle.train import accelerate
from tests.train import rel_err

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ALL = {"lora_linear", "mlp", "projections"}
NO_MLP = {"lora_linear", "projections"}
MOE = dict(num_experts_per_tok=1)

# architecture -> (extra config, the paths accelerate takes)
CASES = {
    "Qwen2": ({}, ALL),
    "Qwen3": ({"head_dim": 8}, ALL),
    "Mistral": ({}, ALL),
    "Gemma2": ({"head_dim": 8}, ALL),
    "Gemma3Text": ({"head_dim": 8}, ALL),
    "Olmo2": ({}, ALL),
    "Cohere": ({}, ALL),
    "Granite": ({}, ALL),
    "SmolLM3": ({}, ALL),
    "Phi3": ({}, {"lora_linear"}),
    "Starcoder2": ({}, NO_MLP),
    "Phi": ({}, NO_MLP),
    "Mixtral": ({"num_local_experts": 2, **MOE}, NO_MLP),
    "Qwen2Moe": ({"num_experts": 2, "moe_intermediate_size": 16,
                  "shared_expert_intermediate_size": 16, **MOE}, ALL),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "dense", "gate_proj", "up_proj",
           "down_proj", "gate_up_proj", "fc1", "fc2", "c_fc", "c_proj")


def _model(arch: str, extra: dict, dtype: torch.dtype) -> torch.nn.Module:
    config_cls = getattr(transformers, f"{arch}Config", None)
    model_cls = getattr(transformers, f"{arch.removesuffix('Text')}ForCausalLM", None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {arch}")
    torch.manual_seed(0)
    config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    return model_cls(config).to(dtype)


@pytest.mark.parametrize("arch", list(CASES))
def test_an_architecture_trains_as_with_peft_alone(arch):
    extra, paths = CASES[arch]
    # MoE experts run grouped GEMMs, which take no float64
    dtype = torch.float32 if "num_experts_per_tok" in extra else torch.float64
    model = _model(arch, extra, dtype)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                             target_modules=[t for t in TARGETS if t in names])
    ref = peft.get_peft_model(model, config)
    fast = copy.deepcopy(ref)
    report = accelerate(fast)
    # peft >= 0.22 turns target_modules naming a MoE block's stacked expert tensors into
    # target_parameters (ParamWrapper layers): those, and only those, keep PEFT's path
    wrapped = {n for n, m in fast.named_modules() if hasattr(m, "parameter_name")}
    assert set(report.skipped) == wrapped, report.skipped
    assert all("stacked expert parameter" in report.skipped[n] for n in wrapped)
    assert set(report.patched.values()) == paths
    lora_layers = {n for n, m in fast.named_modules() if hasattr(m, "lora_A")} - wrapped
    assert lora_layers and lora_layers <= set(report.patched)  # every one on a fast path
    ids = torch.randint(0, 64, (2, 10))
    losses = []
    for m in (ref, fast):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in fast.named_parameters() if p.requires_grad}
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(losses[1], losses[0], rtol=tol, atol=tol)
    assert max(rel_err(got[n], want[n]) for n in want) < tol


def test_adapted_moe_experts_keep_peft_path_and_are_reported():
    """PEFT's ``target_parameters`` adapts a MoE block's stacked expert tensors (a ParamWrapper,
    not a Linear layer): those stay on PEFT's path, named in the report with the reason, and
    the model's gradients are still PEFT's."""
    model = _model("Mixtral", {"num_local_experts": 2, **MOE}, torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             target_parameters=["mlp.experts.gate_up_proj",
                                                "mlp.experts.down_proj"])
    ref = peft.get_peft_model(model, config)
    fast = copy.deepcopy(ref)
    report = accelerate(fast)
    experts = {n for n in report.skipped if n.endswith("mlp.experts")}
    assert len(experts) == 2
    assert all("stacked expert parameter" in report.skipped[n] for n in experts)
    assert set(report.patched.values()) == NO_MLP
    ids = torch.randint(0, 64, (2, 10))
    for m in (ref, fast):
        m(input_ids=ids, labels=ids).loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in fast.named_parameters() if p.requires_grad}
    assert any("experts" in n for n in want)
    assert max(rel_err(got[n], want[n]) for n in want) < 1e-4


def _diffusers_cases():
    d = torch.float64

    def sd3(diffusers):
        model = diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
            pooled_projection_dim=16, out_channels=4)
        return model, dict(hidden_states=torch.randn(1, 4, 8, 8, dtype=d),
                           encoder_hidden_states=torch.randn(1, 5, 16, dtype=d),
                           pooled_projections=torch.randn(1, 16, dtype=d),
                           timestep=torch.tensor([3.0], dtype=d))

    def wan(diffusers):
        model = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
            rope_max_seq_len=32)
        return model, dict(hidden_states=torch.randn(1, 4, 2, 4, 4, dtype=d),
                           timestep=torch.tensor([3]),
                           encoder_hidden_states=torch.randn(1, 5, 16, dtype=d))

    def hunyuan_video(diffusers):
        model = diffusers.HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
            num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1,
            patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
        return model, dict(hidden_states=torch.randn(1, 4, 1, 4, 4, dtype=d),
                           timestep=torch.tensor([3]),
                           encoder_hidden_states=torch.randn(1, 5, 16, dtype=d),
                           encoder_attention_mask=torch.ones(1, 5),
                           pooled_projections=torch.randn(1, 8, dtype=d),
                           guidance=torch.tensor([3.0]))

    def unet(diffusers):
        model = diffusers.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(8, 16), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16,
            attention_head_dim=4, norm_num_groups=4)
        return model, dict(sample=torch.randn(1, 4, 8, 8, dtype=d), timestep=torch.tensor([3]),
                           encoder_hidden_states=torch.randn(1, 5, 16, dtype=d))

    # model -> (its builder, the paths accelerate takes): the self-attention of Wan and of
    # the UNet picks its k/v input at run time and is not grouped (docs/training.md)
    return {"SD3": (sd3, NO_MLP), "Wan": (wan, {"lora_linear"}),
            "HunyuanVideo": (hunyuan_video, NO_MLP), "UNet2DCondition": (unet, {"lora_linear"})}


DIFFUSERS_CASES = _diffusers_cases()


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", list(DIFFUSERS_CASES))
def test_a_diffusers_model_trains_as_with_peft_alone(name, checkpointing):
    """With diffusers' gradient checkpointing too: the recomputed forward takes the paths the
    first one took."""
    diffusers = pytest.importorskip("diffusers")
    build, paths = DIFFUSERS_CASES[name]
    torch.manual_seed(0)
    model, inputs = build(diffusers)
    model = model.to(torch.float64)
    if checkpointing:
        model.enable_gradient_checkpointing()
        model.train()
    targets = sorted({n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                      and any(k in n for k in ("attn", "ff", "proj", "to_"))})
    ref = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets,
                                                     init_lora_weights=False))
    fast = copy.deepcopy(ref)
    report = accelerate(fast)
    assert all("one variable" in why for why in report.skipped.values()), report.skipped
    assert set(report.patched.values()) == paths
    lora_layers = {n for n, m in fast.named_modules() if hasattr(m, "lora_A")}
    assert lora_layers and lora_layers <= set(report.patched)
    checkpointed = re.compile(r"(^|\.)(transformer_blocks|blocks|down_blocks|up_blocks)\.")
    first = fast.get_submodule(min(n for n in lora_layers if checkpointed.search(n)))
    runs = []
    first.register_forward_hook(lambda *_: runs.append(1))
    losses = []
    for m in (ref, fast):
        out = m(**inputs).sample
        loss = (out ** 2).mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=1e-12)
    assert len(runs) == (2 if checkpointing else 1)  # recomputed in backward when checkpointed
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in fast.named_parameters() if p.requires_grad}
    assert max(rel_err(got[n], want[n]) for n in want) < 1e-12
