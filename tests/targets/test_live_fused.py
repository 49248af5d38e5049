"""Adapters on a diffusers model after ``fuse_qkv_projections()``.

Fusing adds ``to_qkv`` (and ``to_added_qkv``, or ``to_kv`` for cross-attention) beside
``to_q``/``to_k``/``to_v`` and sets each attention module's ``fused_projections``; the forward
then reads only the fused layers. Updates of the split layers must reach their rows of the fused
ones (merge, dynamic and offloaded), so the fused model with the adapter computes what the
unfused one with the adapter computes. They stay on the split layers too, which the forward
reads again after an unfuse (the UNet's leaves the flag set).
"""

from __future__ import annotations

import pytest
import torch

import shuttle
from shuttle.offload import ModelOffloader
from shuttle.targets import fused_modules, resolve

pytest.importorskip("diffusers")

STRENGTH = 0.8
ATTN = "transformer_blocks.0.attn"
SINGLE = "single_transformer_blocks.1.attn"


def _flux(fused: bool = False):
    """FLUX's transformer in miniature (hidden 32), as tests/integrations' tiny_flux."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    m = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8]).eval()
    if fused:
        m.fuse_qkv_projections()
    return m


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, 4, generator=g),
            "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
            "pooled_projections": torch.randn(1, 32, generator=g),
            "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(16, 3),
            "txt_ids": torch.zeros(8, 3)}


def _run(m) -> torch.Tensor:
    with torch.no_grad():
        return m(**_inputs()).sample


def _diffusers_lora() -> shuttle.LoRA:
    """diffusers keys on the image and text q/k/v of a double block, the q/k/v of a single
    block, and a layer fusing leaves alone (``to_out.0``)."""
    g = torch.Generator().manual_seed(2)
    sd = {}
    leaves = [f"{ATTN}.{n}" for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj",
                                      "add_v_proj", "to_out.0")]
    for path in leaves + [f"{SINGLE}.{n}" for n in ("to_q", "to_v")]:
        sd[f"transformer.{path}.lora_A.weight"] = torch.randn(4, 32, generator=g) * 0.3
        sd[f"transformer.{path}.lora_B.weight"] = torch.randn(32, 4, generator=g) * 0.3
    return shuttle.load_lora(sd)


def _bfl_kohya_lora() -> shuttle.LoRA:
    """A kohya file in BFL's layout: one fused ``img_attn.qkv`` module (96 rows)."""
    g = torch.Generator().manual_seed(3)
    key = "lora_unet_double_blocks_0_img_attn_qkv"
    return shuttle.load_lora({f"{key}.lora_down.weight": torch.randn(4, 32, generator=g) * 0.3,
                              f"{key}.lora_up.weight": torch.randn(96, 4, generator=g) * 0.3,
                              f"{key}.alpha": torch.tensor(2.0)})


LORAS = {"diffusers": _diffusers_lora, "bfl kohya": _bfl_kohya_lora}


def _reference(lora: shuttle.LoRA) -> torch.Tensor:
    """The unfused model with the adapter merged: what the fused one must compute."""
    m = _flux()
    shuttle.merge_lora(m, [(lora, STRENGTH)])
    return _run(m)


def test_fusing_marks_the_attention_modules():
    assert ATTN in fused_modules(_flux(fused=True))
    assert fused_modules(_flux()) == frozenset()


def test_split_keys_reach_the_rows_of_the_fused_layers():
    res = resolve(_diffusers_lora(), _flux(fused=True))
    assert res.unmatched == {}
    fused = {(f"{ATTN}.to_q", f"{ATTN}.to_qkv", (0, 32)),
             (f"{ATTN}.to_k", f"{ATTN}.to_qkv", (32, 64)),
             (f"{ATTN}.to_v", f"{ATTN}.to_qkv", (64, 96)),
             (f"{ATTN}.add_q_proj", f"{ATTN}.to_added_qkv", (0, 32)),
             (f"{ATTN}.add_k_proj", f"{ATTN}.to_added_qkv", (32, 64)),
             (f"{ATTN}.add_v_proj", f"{ATTN}.to_added_qkv", (64, 96)),
             (f"{SINGLE}.to_q", f"{SINGLE}.to_qkv", (0, 32)),
             (f"{SINGLE}.to_v", f"{SINGLE}.to_qkv", (64, 96))}
    split = {(key, key, None) for key, _, _ in fused} | {(f"{ATTN}.to_out.0",) * 2 + (None,)}
    assert {(t.module_key.split(".", 1)[1], t.param, t.rows) for t in res.targets} == {
        (key, f"{path}.weight", rows) for key, path, rows in fused | split}


def test_an_unfused_model_keeps_its_split_targets():
    res = resolve(_diffusers_lora(), _flux())
    assert res.unmatched == {}
    assert all(t.rows is None and "qkv" not in t.param for t in res.targets)


@pytest.mark.parametrize("kind", list(LORAS))
def test_merge_into_a_fused_model_equals_the_unfused_merge(kind):
    lora = LORAS[kind]()
    want = _reference(lora)
    m = _flux(fused=True)
    base = _run(m)
    report = shuttle.merge_lora(m, [(lora, STRENGTH)])
    assert report.unmatched == {}
    assert {f"{ATTN}.to_qkv.weight", f"{ATTN}.to_q.weight"} <= set(report.applied)
    got = _run(m)
    assert not torch.allclose(got, base, rtol=1e-3, atol=1e-3)  # the update is not negligible
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    m.unfuse_qkv_projections()  # drops to_qkv: the split layers carry the adapter
    torch.testing.assert_close(_run(m), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quality", ["lossless", "fused"])
@pytest.mark.parametrize("kind", list(LORAS))
def test_dynamic_on_a_fused_model_equals_the_unfused_merge(kind, quality):
    lora = LORAS[kind]()
    want = _reference(lora)
    m = _flux(fused=True)
    base = _run(m)
    with shuttle.apply_lora(m, [(lora, STRENGTH)], mode="dynamic", quality=quality):
        got = _run(m)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(_run(m), base)  # detached exactly


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_offloaded_fused_model_equals_the_unfused_merge(cpu_copy, mode):
    lora = _diffusers_lora()
    want = _reference(lora)
    off = ModelOffloader.from_module(_flux(fused=True),
                                     blocks=["transformer_blocks", "single_transformer_blocks"])
    with off.use("cpu", loras=[(lora, STRENGTH)], mode=mode) as m:
        got = _run(m)
        assert f"{ATTN}.to_qkv.weight" in off.adapters.report.applied
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_module_not_marked_fused_keeps_its_split_targets():
    """The flag decides, not the names: with ``fused_projections`` False the forward reads
    ``to_q`` again even though ``to_qkv`` is still there."""
    lora = _diffusers_lora()
    want = _reference(lora)
    m = _flux(fused=True)
    for mod in m.modules():
        if getattr(mod, "fused_projections", False):
            mod.fused_projections = False
    report = shuttle.merge_lora(m, [(lora, STRENGTH)])
    assert f"{ATTN}.to_q.weight" in report.applied
    assert not any("qkv" in p for p in report.applied)
    torch.testing.assert_close(_run(m), want, rtol=1e-5, atol=1e-5)


# -- UNet: diffusers' older Attention class, cross-attention fused to ``to_kv`` -----------------

UNET_ATTN = "down_blocks.0.attentions.0.transformer_blocks.0"


def _unet(fused: bool = False, unfused_again: bool = False):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(4)
    m = UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8,
        norm_num_groups=2, attention_head_dim=2).eval()
    if fused:
        m.fuse_qkv_projections()
    if unfused_again:
        m.unfuse_qkv_projections()
    return m


def _unet_run(m) -> torch.Tensor:
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        return m(torch.randn(1, 4, 8, 8, generator=g), torch.tensor([3]),
                 torch.randn(1, 5, 8, generator=g)).sample


def _unet_lora(m) -> shuttle.LoRA:
    """diffusers keys on q/k/v of the self- (attn1) and cross-attention (attn2)."""
    g = torch.Generator().manual_seed(7)
    shapes = {n: p.shape for n, p in m.named_parameters()}
    sd = {}
    for attn in ("attn1", "attn2"):
        for leaf in ("to_q", "to_k", "to_v"):
            path = f"{UNET_ATTN}.{attn}.{leaf}"
            out, inp = shapes[f"{path}.weight"]
            sd[f"unet.{path}.lora_A.weight"] = torch.randn(2, inp, generator=g)
            sd[f"unet.{path}.lora_B.weight"] = torch.randn(out, 2, generator=g)
    return shuttle.load_lora(sd)


@pytest.mark.parametrize("unfused_again", [False, True])
def test_unet_fused_and_unfused_again_equal_the_unfused_merge(unfused_again):
    """Cross-attention fuses k and v only (``to_kv``; ``to_q`` stays live). After
    ``unfuse_qkv_projections`` the UNet reads the split layers again, its flag still set."""
    ref = _unet()
    lora = _unet_lora(ref)
    shuttle.merge_lora(ref, [(lora, STRENGTH)])
    want = _unet_run(ref)
    m = _unet(fused=True, unfused_again=unfused_again)
    assert f"{UNET_ATTN}.attn2" in fused_modules(m)  # the flag outlives the UNet's unfuse
    base = _unet_run(m)
    report = shuttle.merge_lora(m, [(lora, STRENGTH)])
    assert report.unmatched == {}
    assert {f"{UNET_ATTN}.attn1.to_qkv.weight", f"{UNET_ATTN}.attn2.to_kv.weight",
            f"{UNET_ATTN}.attn2.to_q.weight"} <= set(report.applied)
    got = _unet_run(m)
    assert not torch.allclose(got, base, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
