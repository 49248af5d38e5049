"""BFL control LoRAs (FLUX.1 Canny/Depth) on diffusers' FluxTransformer2DModel.

The file's norm scales land on ``norm_q``/``norm_k`` (``norm_added_*``) as replacements, and its
``img_in`` factors, wider than the model's ``x_embedder``, widen that layer. Checked against
diffusers' own loader (``load_lora_weights`` + ``fuse_lora``, which widens ``x_embedder`` too),
on the tiny Flux of tests/integrations/models.py (4 latent channels, 8 with the control image).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shuttle
from shuttle.errors import NonFiniteAdapterError, ShapeMismatchError, WideningError
from shuttle.targets import resolve
from tests import assert_unchanged, snapshot

pytest.importorskip("diffusers")

REAL = Path(__file__).parents[1] / "data" / "real_keys" / "flux-dev-bfl-control.json"
H, M, R = 32, 128, 4  # tiny Flux: hidden, MLP width; adapter rank
# BFL module template -> (out, in) on the tiny Flux (4 latent channels widened to 8)
_DOUBLE = {"attn.qkv": (3 * H, H), "attn.proj": (H, H), "mlp.0": (M, H), "mlp.2": (H, M),
           "mod.lin": (6 * H, H)}
_SINGLE = {"linear1": (3 * H + M, H), "linear2": (H, H + M), "modulation.lin": (3 * H, H)}
_TOP = {"img_in": (H, 8), "txt_in": (H, 32), "time_in.in_layer": (H, 256),
        "time_in.out_layer": (H, H), "vector_in.in_layer": (H, 32),
        "vector_in.out_layer": (H, H), "final_layer.linear": (4, H),
        "final_layer.adaLN_modulation.1": (2 * H, H)}


def _tiny_transformer():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8]).eval()


def control_lora(seed: int = 0) -> dict[str, torch.Tensor]:
    """A control LoRA in BFL names, laid out as the real file (tests/data/real_keys)."""
    g = torch.Generator().manual_seed(seed)
    modules = {f"double_blocks.{i}.{side}_{k}": v for i in range(2) for side in ("img", "txt")
               for k, v in _DOUBLE.items()}
    modules |= {f"single_blocks.{i}.{k}": v for i in range(3) for k, v in _SINGLE.items()}
    modules |= _TOP
    sd = {}
    for name, (out, inp) in modules.items():
        sd[f"{name}.lora_A.weight"] = torch.randn(R, inp, generator=g) / inp**0.5
        sd[f"{name}.lora_B.weight"] = torch.randn(out, R, generator=g) / R
        sd[f"{name}.lora_B.bias"] = torch.randn(out, generator=g) / 10
    norms = [f"double_blocks.{i}.{s}_attn.norm" for i in range(2) for s in ("img", "txt")]
    norms += [f"single_blocks.{i}.norm" for i in range(3)]
    for n in norms:
        for q in ("query_norm", "key_norm"):
            sd[f"{n}.{q}.scale"] = 1 + torch.randn(16, generator=g) / 10
    return sd


def test_real_layout_resolves_norm_scales_onto_diffusers_names():
    """All 152 norm scales of the real FLUX.1-Depth LoRA land on diffusers' norm weights."""
    from diffusers import FluxTransformer2DModel

    keys = json.loads(REAL.read_text())
    with torch.device("meta"):
        model = FluxTransformer2DModel(guidance_embeds=True, in_channels=64)
    lora = shuttle.load_lora({k: torch.empty(s, device="meta") for k, s in keys.items()})
    res = resolve(lora, model)
    assert res.unmatched == {}
    norms = {t.param: t.module_key for t in res.targets if t.patch.kind == "set"}
    assert len(norms) == 152
    assert norms["transformer_blocks.0.attn.norm_q.weight"] == \
        "double_blocks.0.img_attn.norm.query_norm"
    assert norms["transformer_blocks.18.attn.norm_added_k.weight"] == \
        "double_blocks.18.txt_attn.norm.key_norm"
    assert norms["single_transformer_blocks.37.attn.norm_k.weight"] == \
        "single_blocks.37.norm.key_norm"
    wide = [t for t in res.targets if t.param == "x_embedder.weight"]
    assert [t.patch.in_columns for t in wide] == [128]


def test_norm_scales_on_a_bfl_model_and_back():
    """diffusers-named norm weights onto a BFL-named model (``scale``) through the table."""
    names = {"double_blocks.0.img_attn.qkv.weight": (96, 32),
             "double_blocks.0.txt_attn.norm.key_norm.scale": (16,),
             "single_blocks.0.linear1.weight": (3 * 32 + 128, 32),
             "single_blocks.0.norm.query_norm.scale": (16,)}
    lora = shuttle.load_lora({
        "transformer_blocks.0.attn.norm_added_k.set_weight": torch.ones(16),
        "single_transformer_blocks.0.attn.norm_q.set_weight": torch.ones(16)})
    res = resolve(lora, names)
    assert res.unmatched == {}
    assert sorted(t.param for t in res.targets) == [
        "double_blocks.0.txt_attn.norm.key_norm.scale", "single_blocks.0.norm.query_norm.scale"]


def _inputs(channels: int):
    g = torch.Generator().manual_seed(3)
    return dict(hidden_states=torch.randn(1, 16, channels, generator=g),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g),
                timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3),
                txt_ids=torch.zeros(8, 3), return_dict=False)


def test_merge_matches_float64_math_and_widens_for_good():
    """diffusers' own loader cannot take this file on the tiny Flux (its BFL control converter
    assumes FLUX.1's 19 double and 38 single blocks), so the reference is float64 math over
    the layers as diffusers' converter names them: img_in -> x_embedder (zero-padded to 8
    inputs first, bias delta added), qkv rows -> to_q/to_k/to_v, scales -> norm weights.
    """
    sd = control_lora()
    model = _tiny_transformer()
    base = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    report = shuttle.merge_lora(model, [(sd, 1.0)])
    assert report.unmatched == {}
    assert model.x_embedder.in_features == 8
    assert model.config.in_channels == 8  # FluxControlPipeline sizes its latents from it
    got = {n: p.detach().double() for n, p in model.named_parameters()}

    def update(key):
        return sd[f"{key}.lora_B.weight"].double() @ sd[f"{key}.lora_A.weight"].double()

    want_x = torch.nn.functional.pad(base["x_embedder.weight"], (0, 4)) + update("img_in")
    torch.testing.assert_close(got["x_embedder.weight"], want_x, rtol=0, atol=1e-6)
    torch.testing.assert_close(got["x_embedder.bias"],
                               base["x_embedder.bias"] + sd["img_in.lora_B.bias"].double(),
                               rtol=0, atol=1e-6)
    qkv = update("double_blocks.1.txt_attn.qkv")
    for k, name in enumerate(("add_q_proj", "add_k_proj", "add_v_proj")):
        n = f"transformer_blocks.1.attn.{name}.weight"
        torch.testing.assert_close(got[n], base[n] + qkv[k * H:(k + 1) * H], rtol=0, atol=1e-6)
    for bfl, dif in (
            ("double_blocks.0.img_attn.norm.query_norm", "transformer_blocks.0.attn.norm_q"),
            ("double_blocks.1.txt_attn.norm.key_norm", "transformer_blocks.1.attn.norm_added_k"),
            ("single_blocks.2.norm.query_norm", "single_transformer_blocks.2.attn.norm_q")):
        assert torch.equal(model.get_parameter(f"{dif}.weight"), sd[f"{bfl}.scale"]), dif
    with torch.no_grad():
        model(**_inputs(8))  # the forward takes the widened input


def test_scoped_merge_restores_the_layer_bit_for_bit():
    model = _tiny_transformer()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    weight = model.x_embedder.weight
    original = weight.detach()  # the storage itself: restored, never written
    with torch.no_grad():
        base_out = model(**_inputs(4))[0]
    with shuttle.apply_lora(model, [(control_lora(), 0.7)], mode="merge"):
        assert model.x_embedder.weight is weight and weight.shape == (H, 8)
        assert model.x_embedder.in_features == 8 and model.config.in_channels == 8
        with torch.no_grad():
            model(**_inputs(8))
    assert model.x_embedder.weight is weight and weight.data_ptr() == original.data_ptr()
    assert model.x_embedder.in_features == 4 and model.config.in_channels == 4
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    with torch.no_grad():
        assert torch.equal(model(**_inputs(4))[0], base_out)


def test_scoped_merge_restores_when_the_body_raises():
    model = _tiny_transformer()
    original = model.x_embedder.weight.detach()
    with pytest.raises(KeyError), shuttle.apply_lora(model, [(control_lora(), 1.0)]):
        raise KeyError("body")
    assert model.x_embedder.weight.data_ptr() == original.data_ptr()
    assert model.x_embedder.weight.shape == (H, 4) and model.x_embedder.in_features == 4


def test_widened_update_matches_float64_math():
    sd = control_lora()
    model = _tiny_transformer().double()
    base = model.x_embedder.weight.detach().clone()
    shuttle.merge_lora(model, [(sd, 0.5)])
    want = torch.nn.functional.pad(base, (0, 4)) + 0.5 * (
        sd["img_in.lora_B.weight"].double() @ sd["img_in.lora_A.weight"].double())
    torch.testing.assert_close(model.x_embedder.weight.detach(), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("how", ["merge", "scoped"])
def test_nan_in_a_later_key_leaves_the_model_unchanged(how):
    sd = control_lora()
    sd["single_blocks.2.linear2.lora_B.weight"][0, 0] = float("nan")
    model = _tiny_transformer()
    saved = snapshot(model)
    with pytest.raises(NonFiniteAdapterError):
        if how == "merge":
            shuttle.merge_lora(model, [(sd, 1.0)])
        else:
            with shuttle.apply_lora(model, [(sd, 1.0)]):
                pytest.fail("the body must not run")
    assert_unchanged(model, saved)
    assert model.x_embedder.in_features == 4


def test_overflow_during_the_merge_puts_the_widened_layer_back():
    """A failure after the layer was widened (float16 overflow in a later weight)."""
    sd = control_lora()
    sd["single_blocks.2.linear2.lora_B.weight"] *= 1e6
    model = _tiny_transformer().half()
    original = model.x_embedder.weight.detach()
    with pytest.raises(NonFiniteAdapterError):
        shuttle.merge_lora(model, [(sd, 1.0)])
    assert model.x_embedder.weight.data_ptr() == original.data_ptr()
    assert model.x_embedder.weight.shape == (H, 4) and model.x_embedder.in_features == 4


@pytest.mark.parametrize("mode", ["dynamic", "auto"])
def test_other_modes_refuse_widening_by_name(mode):
    model = _tiny_transformer()
    saved = snapshot(model)
    with pytest.raises(WideningError, match='mode="merge"'), \
            shuttle.apply_lora(model, [(control_lora(), 1.0)], mode=mode):
        pytest.fail("the body must not run")
    assert_unchanged(model, saved)


def test_offloader_refuses_widening():
    model = _tiny_transformer()
    off = shuttle.ModelOffloader.from_module(model, blocks=["transformer_blocks"])
    with pytest.raises(WideningError), off.use("cpu", loras=[(control_lora(), 1.0)],
                                               mode="merge"):
        pytest.fail("the body must not run")


def test_two_adapters_of_different_widths_are_refused():
    wider = {k: v for k, v in control_lora().items() if k.startswith("img_in")}
    wider["img_in.lora_A.weight"] = torch.randn(R, 12)
    model = _tiny_transformer()
    saved = snapshot(model)
    with pytest.raises(ShapeMismatchError, match="differently"):
        shuttle.merge_lora(model, [(control_lora(), 1.0), (wider, 1.0)])
    assert_unchanged(model, saved)


def test_a_layer_no_family_widens_stays_a_shape_mismatch():
    sd = control_lora()
    sd["txt_in.lora_A.weight"] = torch.randn(R, 40)  # 40 inputs where context_embedder has 32
    model = _tiny_transformer()
    saved = snapshot(model)
    with pytest.raises(ShapeMismatchError) as info:
        shuttle.merge_lora(model, [(sd, 1.0)])
    assert not isinstance(info.value, WideningError)
    assert_unchanged(model, saved)
