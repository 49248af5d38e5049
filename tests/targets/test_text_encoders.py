"""kohya's text encoder prefixes on SDXL's two CLIP encoders as transformers 5 builds them.

transformers 5's ``CLIPTextModel`` (SDXL's ``text_encoder``, CLIP-L) has no ``text_model.``
level; ``CLIPTextModelWithProjection`` (``text_encoder_2``, CLIP-G) keeps it. kohya spells it
for both (``lora_te1_text_model_encoder_...``), so the spelling as written matches only
``text_encoder_2``: the prefix must pin its component (``lora_te_``/``lora_te1_`` ->
``text_encoder``, ``lora_te2_`` -> ``text_encoder_2``), or a te1 file lands on the wrong
encoder and a file with both raises :class:`DuplicateTargetError`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import DuplicateTargetError
from shuttle.integrations.routing import route_lora
from shuttle.targets import ModelNames, resolve

pytest.importorskip("transformers")

RANK, ALPHA, STRENGTH = 2, 3.0, 0.7
UNET_KEY = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
# (kohya layer path below the encoder layer, model path below it); heights differ (8 vs 16).
LAYERS = (("self_attn_q_proj", "self_attn.q_proj"), ("mlp_fc1", "mlp.fc1"))


def _clip_config(layers: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=layers,
                          num_attention_heads=2, vocab_size=16, max_position_embeddings=8,
                          projection_dim=8, bos_token_id=0, eos_token_id=2, pad_token_id=1)


def _components() -> dict[str, nn.Module]:
    """SDXL-like: CLIP-L of one layer, CLIP-G (with projection) of two, a tiny UNet."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8,
        norm_num_groups=2, attention_head_dim=2)
    return {"text_encoder": CLIPTextModel(_clip_config(1)),
            "text_encoder_2": CLIPTextModelWithProjection(_clip_config(2)), "unet": unet}


# kohya prefix -> (component, that component's module path before ``encoder.layers.N``)
OWNER = {"lora_te_": ("text_encoder", ""), "lora_te1_": ("text_encoder", ""),
         "lora_te2_": ("text_encoder_2", "text_model.")}
FILES = {  # adapter -> its (prefix, encoder layer) pairs, each with every LAYERS entry
    "te1 only": [("lora_te1_", 0)],
    "te only (SD1.5 spelling)": [("lora_te_", 0)],
    "te2 only": [("lora_te2_", 0), ("lora_te2_", 1)],
    "both encoders": [("lora_te1_", 0), ("lora_te2_", 0), ("lora_te2_", 1)],
}


def _kohya_file(pairs, unet: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A kohya state dict, and module key -> the module path (``component.path``) it means."""
    g = torch.Generator().manual_seed(3)
    sd, means = {}, {}
    for prefix, layer in pairs:
        comp, level = OWNER[prefix]
        for kohya, path in LAYERS:
            key = f"{prefix}text_model_encoder_layers_{layer}_{kohya}"
            out = 16 if kohya == "mlp_fc1" else 8
            sd[f"{key}.lora_down.weight"] = torch.randn(RANK, 8, generator=g)
            sd[f"{key}.lora_up.weight"] = torch.randn(out, RANK, generator=g)
            sd[f"{key}.alpha"] = torch.tensor(ALPHA)
            means[key] = f"{comp}.{level}encoder.layers.{layer}.{path}"
    if unet:
        sd[f"{UNET_KEY}.lora_down.weight"] = torch.randn(RANK, 4, generator=g)
        sd[f"{UNET_KEY}.lora_up.weight"] = torch.randn(4, RANK, generator=g)
        sd[f"{UNET_KEY}.alpha"] = torch.tensor(ALPHA)
        means[UNET_KEY] = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    return sd, means


def _routing_names(components: dict[str, nn.Module]) -> ModelNames:
    """All components' parameters under their names as roots, as route_lora indexes them."""
    return ModelNames({f"{c}.{n}": p.shape for c, m in components.items()
                       for n, p in m.named_parameters()})


def test_transformers_5_clip_levels():
    """The case under test: only the encoder with a projection keeps ``text_model.``."""
    comps = _components()
    te1 = dict(comps["text_encoder"].named_parameters())
    te2 = dict(comps["text_encoder_2"].named_parameters())
    assert "encoder.layers.0.self_attn.q_proj.weight" in te1
    assert "text_model.encoder.layers.0.self_attn.q_proj.weight" in te2


@pytest.mark.parametrize("unet", [False, True])
@pytest.mark.parametrize("file", list(FILES))
def test_each_prefix_lands_on_its_own_encoder(file, unet):
    comps = _components()
    sd, means = _kohya_file(FILES[file], unet)
    lora = shuttle.load_lora(sd)
    res = resolve(lora, _routing_names(comps))
    assert res.unmatched == {}
    assert {t.module_key: t.param for t in res.targets} == {
        k: f"{p}.weight" for k, p in means.items()}
    routed, unmatched = route_lora(lora, comps)
    assert unmatched == {}
    assert {c: set(sub.modules) for c, sub in routed.items()} == {
        c: {k for k, p in means.items() if p.startswith(c + ".")}
        for c in {p.split(".", 1)[0] for p in means.values()}}


@pytest.mark.parametrize("file", list(FILES))
def test_merging_each_encoders_share_equals_float64(file):
    comps = _components()
    sd, means = _kohya_file(FILES[file], unet=True)
    before = {c: {n: p.detach().clone() for n, p in m.named_parameters()}
              for c, m in comps.items()}
    routed, unmatched = route_lora(shuttle.load_lora(sd), comps)
    assert unmatched == {}
    for comp, sub in routed.items():
        report = shuttle.merge_lora(comps[comp], [(sub, STRENGTH)])
        assert report.unmatched == {}
    want = {c: {n: t.double() for n, t in ps.items()} for c, ps in before.items()}
    for key, path in means.items():
        comp, module = path.split(".", 1)
        up, down = sd[f"{key}.lora_up.weight"].double(), sd[f"{key}.lora_down.weight"].double()
        want[comp][f"{module}.weight"] += STRENGTH * ALPHA / RANK * up @ down
    for comp, m in comps.items():
        for n, p in m.named_parameters():
            if torch.equal(want[comp][n], before[comp][n].double()):
                assert torch.equal(p, before[comp][n]), f"{comp}.{n} changed"
            else:
                torch.testing.assert_close(p.double(), want[comp][n], rtol=1e-6, atol=1e-6,
                                           msg=f"{comp}.{n}")


def test_te1_key_for_a_layer_only_text_encoder_2_has_is_not_sent_there():
    """CLIP-L has one layer here, CLIP-G two: ``lora_te1_`` layer 1 is CLIP-L's, not CLIP-G's."""
    comps = _components()
    sd, _ = _kohya_file([("lora_te1_", 1)])
    res = resolve(shuttle.load_lora(sd), _routing_names(comps))
    assert res.targets == []
    assert set(res.unmatched) == {f"lora_te1_text_model_encoder_layers_1_{k}" for k, _ in LAYERS}
    assert all("no module" in why for why in res.unmatched.values())


def test_a_lone_encoder_cannot_tell_te1_from_te2():
    """On one encoder alone both prefixes fit; the clash is an error, never a guess."""
    comps = _components()
    sd, _ = _kohya_file(FILES["both encoders"])
    te2 = comps["text_encoder_2"]
    before = {n: p.detach().clone() for n, p in te2.named_parameters()}
    with pytest.raises(DuplicateTargetError, match="lora_te1_.*lora_te2_|lora_te2_.*lora_te1_"):
        shuttle.merge_lora(te2, [(shuttle.load_lora(sd), 1.0)])
    assert all(torch.equal(p, before[n]) for n, p in te2.named_parameters())
