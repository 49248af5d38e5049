"""save_lora: peft / kohya / comfy round trips are bit-exact, and merge exactly like the source."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from shuttle import load_lora, merge_lora, resolve, save_lora
from shuttle.errors import UnsupportedFormatError
from shuttle.formats import LoRA
from shuttle.patches import DoRA, LowRank, materialize

P = "base_model.model."


# -- a small model and adapters for it --------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(5, 12)
        self.to_out = nn.Linear(12, 5)
        self.norm = nn.Module()
        self.norm.query_norm = RMSNorm(4)
        self.norm.key_norm = RMSNorm(4)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.img_attn = Attn()


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 8)
        self.conv = nn.Conv2d(3, 5, 3)
        self.conv2 = nn.Conv2d(5, 4, 3)
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.emb = nn.Embedding(20, 8)
        self.img_in = nn.Linear(6, 8)
        self.double_blocks = nn.ModuleList([Block()])


def kohya_adapter() -> dict[str, torch.Tensor]:
    """Every LyCORIS/kohya kind on kohya names of Small."""
    t = torch.tensor
    return {
        "lora_unet_proj.lora_down.weight": torch.randn(2, 6),
        "lora_unet_proj.lora_up.weight": torch.randn(8, 2),
        "lora_unet_proj.alpha": t(1.0),
        "lora_unet_proj.diff_b": torch.randn(8),
        "lora_unet_conv.lora_down.weight": torch.randn(2, 3, 3, 3),
        "lora_unet_conv.lora_up.weight": torch.randn(5, 2, 1, 1),
        "lora_unet_conv.alpha": t(3.0),
        "lora_unet_conv2.lora_down.weight": torch.randn(3, 5, 1, 1),
        "lora_unet_conv2.lora_mid.weight": torch.randn(3, 3, 3, 3),
        "lora_unet_conv2.lora_up.weight": torch.randn(4, 3, 1, 1),
        "lora_unet_conv2.alpha": t(2.0),
        "lora_unet_fc1.lora_down.weight": torch.randn(4, 8).bfloat16(),
        "lora_unet_fc1.lora_up.weight": torch.randn(16, 4).bfloat16(),
        "lora_unet_fc1.alpha": t(2.0, dtype=torch.bfloat16),
        "lora_unet_fc1.dora_scale": (torch.rand(16, 1) + 0.5).bfloat16(),
        "lora_unet_fc2.weight": torch.randn(16) * 0.1,
        "lora_unet_fc2.on_input": t(True),
        "lora_unet_double_blocks_0_img_attn_qkv.hada_w1_a": torch.randn(12, 2),
        "lora_unet_double_blocks_0_img_attn_qkv.hada_w1_b": torch.randn(2, 5),
        "lora_unet_double_blocks_0_img_attn_qkv.hada_w2_a": torch.randn(12, 2),
        "lora_unet_double_blocks_0_img_attn_qkv.hada_w2_b": torch.randn(2, 5),
        "lora_unet_double_blocks_0_img_attn_qkv.alpha": t(1.0),
        "lora_unet_double_blocks_0_img_attn_to_out.lokr_w1": torch.randn(1, 3),
        "lora_unet_double_blocks_0_img_attn_to_out.lokr_w2_a": torch.randn(5, 2),
        "lora_unet_double_blocks_0_img_attn_to_out.lokr_w2_b": torch.randn(2, 4),
        "lora_unet_double_blocks_0_img_attn_to_out.alpha": t(1.0),
        "lora_unet_norm.w_norm": torch.randn(8) * 0.1,
        "lora_unet_norm.b_norm": torch.randn(8) * 0.1,
    }


def peft_plain() -> tuple[dict[str, torch.Tensor], dict]:
    """PEFT LoRA factors on Linear and Conv layers, with rank and alpha patterns."""
    sd = {
        f"{P}proj.lora_A.weight": torch.randn(4, 6), f"{P}proj.lora_B.weight": torch.randn(8, 4),
        f"{P}conv.lora_A.weight": torch.randn(2, 3, 3, 3),
        f"{P}conv.lora_B.weight": torch.randn(5, 2, 1, 1),
        f"{P}double_blocks.0.img_attn.qkv.lora_A.weight": torch.randn(4, 5),
        f"{P}double_blocks.0.img_attn.qkv.lora_B.weight": torch.randn(12, 4),
    }
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "rank_pattern": {"conv": 2},
           "alpha_pattern": {"conv": 3}}
    return sd, cfg


def peft_only() -> tuple[dict[str, torch.Tensor], dict]:
    """What only PEFT spells: DoRA magnitudes, scaled lora_B.bias, embeddings, rsLoRA."""
    sd = {
        f"{P}fc1.lora_A.weight": torch.randn(8, 8), f"{P}fc1.lora_B.weight": torch.randn(16, 8),
        f"{P}fc1.lora_magnitude_vector": torch.rand(16) + 0.5,
        f"{P}proj.lora_A.weight": torch.randn(8, 6), f"{P}proj.lora_B.weight": torch.randn(8, 8),
        f"{P}proj.lora_B.bias": torch.randn(8),
        f"{P}emb.lora_embedding_A": torch.randn(4, 20),
        f"{P}emb.lora_embedding_B": torch.randn(8, 4),
    }
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": True, "use_dora": True,
           "rank_pattern": {"emb": 4}, "lora_bias": True}
    return sd, cfg


def comfy_adapter() -> dict[str, torch.Tensor]:
    return {
        "diffusion_model.proj.lora_A.weight": torch.randn(2, 6),
        "diffusion_model.proj.lora_B.weight": torch.randn(8, 2),
        "diffusion_model.proj.alpha": torch.tensor(3.0),
        "diffusion_model.proj.diff_b": torch.randn(8),
        "diffusion_model.conv.diff": torch.randn(5, 3, 3, 3) * 0.1,
        "diffusion_model.norm.set_weight": torch.randn(8),
        "diffusion_model.fc2.diff_b": torch.randn(8),
    }


def bfl_adapter() -> dict[str, torch.Tensor]:
    return {
        "double_blocks.0.img_attn.norm.query_norm.scale": torch.randn(4),
        "double_blocks.0.img_attn.norm.key_norm.scale": torch.randn(4),
        "img_in.lora_A.weight": torch.randn(2, 6),
        "img_in.lora_B.weight": torch.randn(8, 2),
        "img_in.lora_B.bias": torch.randn(8),
    }


# -- helpers ----------------------------------------------------------------------------------


def scale_of(p):
    return p.inner.scale if isinstance(p, DoRA) else getattr(p, "scale", None)


def assert_same_patches(a: LoRA, b: LoRA, names: dict[str, str]) -> None:
    """Module ``old`` of ``a`` is module ``names[old]`` of ``b`` with bit-identical patches."""
    assert sorted(b.modules) == sorted(names.values())
    for old, new in names.items():
        pa, pb = a.modules[old], b.modules[new]
        assert [(p.kind, p.param) for p in pa] == [(p.kind, p.param) for p in pb], old
        for x, y in zip(pa, pb, strict=True):
            assert scale_of(x) == scale_of(y), old
            if isinstance(x, DoRA):
                assert x.mode == y.mode
            inner_x = x.inner if isinstance(x, DoRA) else x
            inner_y = y.inner if isinstance(y, DoRA) else y
            if isinstance(inner_x, LowRank):
                assert inner_x.effective_scale == inner_y.effective_scale
                assert inner_x.transposed == inner_y.transposed
            if x.kind == "ia3":
                assert x.on_input == y.on_input
            tx, ty = dict(x.tensors()), dict(y.tensors())
            assert list(tx) == list(ty), old
            for field in tx:
                u, v = materialize(tx[field]), materialize(ty[field])
                assert u.dtype == v.dtype and u.shape == v.shape, (old, field)
                assert torch.equal(u, v), (old, field)


def assert_same_merge(a: LoRA, b: LoRA, model: nn.Module, strengths=(1.0, 0.7),
                      mapping=None) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for k in strengths:
            m1 = copy.deepcopy(model).to(dtype)
            m2 = copy.deepcopy(m1)
            r1 = merge_lora(m1, [(a, k)])
            r2 = merge_lora(m2, [(b, k)], mapping=mapping)
            assert r1.unmatched == {} and r2.unmatched == {}
            assert sorted(r1.applied) == sorted(r2.applied) and r1.applied
            changed = False
            for (n1, p1), (n2, p2) in zip(m1.named_parameters(), m2.named_parameters(),
                                          strict=True):
                assert n1 == n2
                assert torch.equal(p1, p2), (n1, dtype, k)
                changed |= not torch.equal(p1, dict(model.named_parameters())[n1].to(dtype))
            assert changed


def no_files_written(tmp_path) -> bool:
    return not any(tmp_path.iterdir())


@pytest.fixture
def model() -> nn.Module:
    return Small()


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("to", ["kohya", "comfy"])
def test_kohya_all_kinds_round_trip(tmp_path, model, to):
    src = load_lora(kohya_adapter())
    assert src.kinds() == {"lora": 3, "diff": 3, "dora": 1, "ia3": 1, "loha": 1, "lokr": 1}
    out = save_lora(src, tmp_path / "out.safetensors", to=to)
    assert out == tmp_path / "out.safetensors" and out.is_file()
    back = load_lora(out)
    assert back.metadata["shuttle_source_format"] == src.format
    assert_same_patches(src, back, {m: m for m in src.modules})
    assert_same_merge(src, back, model)


@pytest.mark.parametrize("to", ["peft", "kohya", "comfy"])
def test_peft_lora_round_trip(tmp_path, model, to):
    sd, cfg = peft_plain()
    src = load_lora(sd, config=cfg)
    assert scale_of(src.modules[f"{P}conv"][0]) == 1.5
    out = save_lora(src, tmp_path / ("ad" if to == "peft" else "out.safetensors"), to=to)
    if to == "peft":
        assert out == tmp_path / "ad" / "adapter_model.safetensors"
        back = load_lora(tmp_path / "ad")
        names = {m: m for m in src.modules}
        mapping = None
    else:
        back = load_lora(out)
        names = {
            f"{P}proj": "lora_unet_proj" if to == "kohya" else "proj",
            f"{P}conv": "lora_unet_conv" if to == "kohya" else "conv",
            f"{P}double_blocks.0.img_attn.qkv": "lora_unet_double_blocks_0_img_attn_qkv"
            if to == "kohya" else "double_blocks.0.img_attn.qkv",
        }
        mapping = None
    assert_same_patches(src, back, names)
    assert_same_merge(src, back, model, mapping=mapping)


def test_peft_only_features_round_trip(tmp_path, model):
    sd, cfg = peft_only()
    src = load_lora(sd, config=cfg)
    save_lora(src, tmp_path / "ad", to="peft")
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["use_dora"] and config["lora_bias"]
    assert not config["use_rslora"]  # scales are spelled as alpha / r instead
    back = load_lora(tmp_path / "ad")
    assert_same_patches(src, back, {m: m for m in src.modules})
    assert_same_merge(src, back, model, strengths=(1.0, 0.7, -0.4))


@pytest.mark.parametrize("to", ["kohya", "comfy"])
def test_peft_rslora_scale_survives_kohya_alpha(tmp_path, model, to):
    # alpha / sqrt(r) is not a float32 number times anything simple: the float64 alpha the
    # writer stores must be read back in float64.
    sd, _ = peft_plain()
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 7, "use_rslora": True,
           "rank_pattern": {"conv": 2}}
    src = load_lora(sd, config=cfg)
    back = load_lora(save_lora(src, tmp_path / "out.safetensors", to=to))
    for (_, a), (_, b) in zip(sorted(src.patches(), key=lambda x: x[1].shapes()["up"]),
                              sorted(back.patches(), key=lambda x: x[1].shapes()["up"]),
                              strict=True):
        assert a.scale == b.scale
    assert_same_merge(src, back, model)


def test_peft_directory_to_peft_and_kohya(tmp_path, model):
    # from a real directory (lazy tensors) rather than a state dict
    from safetensors.torch import save_file

    sd, cfg = peft_plain()
    d = tmp_path / "src"
    d.mkdir()
    save_file(sd, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    src = load_lora(d)
    save_lora(src, tmp_path / "again", to="peft")
    back = load_lora(tmp_path / "again")
    assert_same_patches(src, back, {m: m for m in src.modules})
    assert_same_merge(src, back, model)


@pytest.mark.parametrize("to", ["kohya", "comfy"])
def test_comfy_round_trip(tmp_path, model, to):
    src = load_lora(comfy_adapter())
    assert src.format == "comfy"
    back = load_lora(save_lora(src, tmp_path / "out.safetensors", to=to))
    if to == "kohya":
        names = {m: "lora_unet_" + m.removeprefix("diffusion_model.") for m in src.modules}
    else:
        names = {m: m for m in src.modules}
    assert_same_patches(src, back, names)
    assert_same_merge(src, back, model, strengths=(1.0, 0.7, 2.0))


def test_bfl_control_to_comfy(tmp_path, model):
    src = load_lora(bfl_adapter())
    assert src.format == "bfl-control"
    back = load_lora(save_lora(src, tmp_path / "out.safetensors", to="comfy"))
    # The norm scales become "<norm>.scale.set_weight": a Set of the bare parameter.
    q, k = "double_blocks.0.img_attn.norm.query_norm", "double_blocks.0.img_attn.norm.key_norm"
    for name in (q, k):
        (a,) = src.modules[name]
        (b,) = back.modules[f"{name}.scale"]
        assert a.kind == b.kind == "set"
        assert torch.equal(materialize(a.value), materialize(b.value))
    main_a, bias_a = src.modules["img_in"]
    main_b, bias_b = back.modules["img_in"]
    assert torch.equal(main_a.up, main_b.load().up) and main_a.scale == main_b.scale
    assert torch.equal(bias_a.diff, bias_b.load().diff) and bias_a.scale == bias_b.scale
    assert_same_merge(src, back, model)


def test_kohya_to_peft_names_need_a_mapping(tmp_path, model):
    # kohya's underscored names are not module paths: written as PEFT keys, neither PEFT nor
    # shuttle could apply them. Refused (nothing written) unless a mapping names the modules
    # (made from the model by resolving the keys against it).
    sd = {k: v for k, v in kohya_adapter().items()
          if k.startswith(("lora_unet_proj.lora", "lora_unet_proj.alpha", "lora_unet_conv."))}
    src = load_lora(sd)
    with pytest.raises(UnsupportedFormatError, match="kohya name.*Convert to kohya or comfy"):
        save_lora(src, tmp_path / "ad", to="peft")
    assert no_files_written(tmp_path)
    paths = {t.module_key: t.param.rpartition(".")[0] for t in resolve(src, model).targets
             if t.rows is None}  # the caller resolves: the writer reads no model
    save_lora(src, tmp_path / "ad", to="peft", mapping=paths)
    back = load_lora(tmp_path / "ad")
    assert_same_patches(src, back, {"lora_unet_proj": f"{P}proj", "lora_unet_conv": f"{P}conv"})
    assert_same_merge(src, back, model)  # placed without a mapping: real module paths
    save_lora(src, tmp_path / "ad2", to="peft",
              mapping={"lora_unet_proj": "proj", "lora_unet_conv": "conv"})
    assert sorted(load_lora(tmp_path / "ad2").modules) == [f"{P}conv", f"{P}proj"]


# -- what a format cannot spell ---------------------------------------------------------------


def lycoris(kind: str) -> LoRA:
    sd = kohya_adapter()
    keep = {"loha": "img_attn_qkv", "lokr": "img_attn_to_out", "ia3": "fc2", "tucker": "conv2",
            "diff": "lora_unet_norm", "dora_scale": "fc1"}[kind]
    return load_lora({k: v for k, v in sd.items() if keep in k})


@pytest.mark.parametrize("kind", ["loha", "lokr", "ia3", "tucker", "diff", "dora_scale"])
def test_peft_cannot_spell(tmp_path, kind):
    with pytest.raises(UnsupportedFormatError, match="PEFT|peft|magnitude"):
        save_lora(lycoris(kind), tmp_path / "ad", to="peft")
    assert no_files_written(tmp_path)


def test_peft_cannot_spell_split_qkv_or_set(tmp_path):
    up = torch.block_diag(torch.randn(4, 1), torch.randn(4, 1), torch.randn(4, 1))
    sd = {"lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": up,
          "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.randn(3, 5),
          "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(1.0)}
    split = load_lora(sd)
    assert next(split.patches())[1].split_qkv
    with pytest.raises(UnsupportedFormatError, match="no PEFT LoRA spelling"):
        save_lora(split, tmp_path / "ad", to="peft")
    with pytest.raises(UnsupportedFormatError, match="no PEFT LoRA spelling"):
        save_lora(load_lora(bfl_adapter()), tmp_path / "ad", to="peft")
    assert no_files_written(tmp_path)


def test_peft_cannot_spell_unscaled_bias_beside_scaled_lora(tmp_path):
    # comfy's diff_b is added as is; PEFT's lora_B.bias takes the LoRA's alpha / r.
    src = load_lora(comfy_adapter())
    with pytest.raises(UnsupportedFormatError, match="lora_B.bias"):
        save_lora(src, tmp_path / "ad", to="peft")
    assert no_files_written(tmp_path)


@pytest.mark.parametrize("to", ["kohya", "comfy"])
def test_kohya_comfy_cannot_spell_peft_only(tmp_path, to):
    sd, cfg = peft_only()
    for keep, match in (("fc1", "magnitude"), ("emb", "transposed"), ("proj", "scaled bias")):
        src = load_lora({k: v for k, v in sd.items() if f".{keep}." in k}, config=cfg)
        with pytest.raises(UnsupportedFormatError, match=match):
            save_lora(src, tmp_path / "out.safetensors", to=to)
    assert no_files_written(tmp_path)


def test_kohya_cannot_spell_norm_scale_set(tmp_path):
    with pytest.raises(UnsupportedFormatError, match="no kohya spelling"):
        save_lora(load_lora(bfl_adapter()), tmp_path / "out.safetensors", to="kohya")
    assert no_files_written(tmp_path)


def test_peft_dora_inner_mode_keeps_strength_rule(tmp_path, model):
    # inner and blend DoRA agree only at strength 1: PEFT's must not turn into a dora_scale.
    sd, cfg = peft_only()
    src = load_lora({k: v for k, v in sd.items() if ".fc1." in k}, config=cfg)
    for to in ("kohya", "comfy"):
        with pytest.raises(UnsupportedFormatError, match="convert to peft"):
            save_lora(src, tmp_path / "out.safetensors", to=to)
    assert no_files_written(tmp_path)


def test_blend_dora_not_written_as_peft(tmp_path):
    with pytest.raises(UnsupportedFormatError, match="dora_scale"):
        save_lora(lycoris("dora_scale"), tmp_path / "ad", to="peft")
    assert no_files_written(tmp_path)


def test_unknown_target(tmp_path):
    with pytest.raises(ValueError, match="expected one of"):
        save_lora(load_lora(kohya_adapter()), tmp_path / "x.safetensors", to="onetrainer")
    assert no_files_written(tmp_path)


def test_overwrites_existing_file_atomically(tmp_path):
    f = tmp_path / "out.safetensors"
    save_lora(load_lora(comfy_adapter()), f, to="comfy")
    src = load_lora(kohya_adapter())
    save_lora(src, f, to="kohya")
    assert sorted(load_lora(f).modules) == sorted(src.modules)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"]


@pytest.mark.parametrize("to", ["kohya", "comfy"])
def test_scale_zero_has_no_alpha_spelling(tmp_path, to):
    # alpha 0 means alpha = rank to every kohya reader, so scale 0 cannot be written as alpha.
    sd, _ = peft_plain()
    src = load_lora(sd, config={"r": 4, "lora_alpha": 0})
    assert scale_of(next(src.patches())[1]) == 0.0
    with pytest.raises(UnsupportedFormatError, match="scale 0"):
        save_lora(src, tmp_path / "out.safetensors", to=to)
    assert no_files_written(tmp_path)
    save_lora(src, tmp_path / "ad", to="peft")
    back = load_lora(tmp_path / "ad")
    assert_same_patches(src, back, {m: m for m in src.modules})


@pytest.mark.parametrize("to", ["kohya", "comfy"])
def test_block_diagonal_qkv_not_mistaken_for_split_save(tmp_path, model, to):
    up = torch.block_diag(torch.randn(4, 1), torch.randn(4, 1), torch.randn(4, 1))
    src = load_lora({f"{P}double_blocks.0.img_attn.qkv.lora_A.weight": torch.randn(3, 5),
                     f"{P}double_blocks.0.img_attn.qkv.lora_B.weight": up})
    assert not next(src.patches())[1].split_qkv
    with pytest.raises(UnsupportedFormatError, match="split-qkv"):
        save_lora(src, tmp_path / "out.safetensors", to=to)
    assert no_files_written(tmp_path)
    # a dense up on the same layer converts exactly
    src = load_lora({f"{P}double_blocks.0.img_attn.qkv.lora_A.weight": torch.randn(3, 5),
                     f"{P}double_blocks.0.img_attn.qkv.lora_B.weight": torch.randn(12, 3)})
    back = load_lora(save_lora(src, tmp_path / "out.safetensors", to=to))
    assert_same_merge(src, back, model)


@pytest.mark.parametrize("to", ["kohya", "comfy"])
def test_kohya_split_qkv_round_trip(tmp_path, model, to):
    up = torch.block_diag(torch.randn(4, 2), torch.randn(4, 2), torch.randn(4, 2))
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    src = load_lora({f"{name}.lora_up.weight": up, f"{name}.lora_down.weight": torch.randn(6, 5),
                     f"{name}.alpha": torch.tensor(1.0)})
    (p,) = src.modules[name]
    assert p.split_qkv and p.effective_scale == pytest.approx(0.5)
    back = load_lora(save_lora(src, tmp_path / "out.safetensors", to=to))
    assert_same_patches(src, back, {name: name})
    assert back.modules[name][0].split_qkv
    assert_same_merge(src, back, model)


@pytest.mark.parametrize("to", ["comfy", "kohya"])
def test_peft_lokr_with_a_3d_w2_has_no_lycoris_spelling(tmp_path, to):
    """PEFT places a Conv1d's kron(w1, w2 (c, d, k)) otherwise than LyCORIS readers: written in
    their spelling it would merge as another update, so it is refused; a PEFT file that the
    LoKr layouts agree on (a 4-D w2) still converts."""
    w1 = torch.randn(2, 2)
    conv1d = {f"{P}conv.lokr_w1": w1, f"{P}conv.lokr_w2": torch.randn(3, 2, 3)}
    cfg = {"peft_type": "LOKR", "r": 4, "alpha": 4}
    with pytest.raises(UnsupportedFormatError, match="3-D lokr_w2"):
        save_lora(load_lora(conv1d, config=cfg), tmp_path / "a.safetensors", to=to)
    assert no_files_written(tmp_path)
    conv2d = {f"{P}conv.lokr_w1": w1, f"{P}conv.lokr_w2": torch.randn(3, 2, 3, 3)}
    save_lora(load_lora(conv2d, config=cfg), tmp_path / "b.safetensors", to=to)


def test_every_patch_kind_but_peft_copies_has_a_kohya_comfy_spelling():
    """PEFT's saved copies (whole, or embedding rows) have none; experts_lora says why it has
    none (its own spell)."""
    from shuttle.patches import PATCH_KINDS, PatchKind

    spelled = {n for n, k in PATCH_KINDS.items() if type(k).spell is not PatchKind.spell}
    assert spelled == set(PATCH_KINDS) - {"replace", "replace_rows"}


def test_a_patch_kind_without_a_spelling_is_refused_naming_the_fix(tmp_path):
    """The writer dispatches through the kind registry: a kind added with register_patch has
    no spelling, a typed error that names the fix, and nothing is written."""
    import dataclasses

    from shuttle.patches import PATCH_KINDS, Patch, register_patch

    @register_patch("test-halved-diff")
    @dataclasses.dataclass(frozen=True, eq=False)
    class HalvedDiff(Patch):
        diff: torch.Tensor = None
        tensor_fields = ("diff",)

    try:
        lora = LoRA("comfy", {"lin": [HalvedDiff("weight", diff=torch.ones(2, 3))]})
        with pytest.raises(UnsupportedFormatError, match="override spell"):
            save_lora(lora, tmp_path / "a.safetensors", to="comfy")
        assert not (tmp_path / "a.safetensors").exists()
    finally:
        PATCH_KINDS.pop("test-halved-diff", None)


def test_a_models_own_paths_keep_a_component_like_head(tmp_path):
    """A model-level diffusers file (``save_lora_adapter``: a flat config, keys relative to the
    model) whose paths start with ``transformer.`` (GPT-2's ``transformer.h``) is no pipeline
    file: its keys are written as they are. A pipeline file of the same keys loses the prefix.
    """
    from safetensors.torch import save_file

    from shuttle.formats.writer import pipeline_components

    sd = {"transformer.h.0.attn.lora_A.weight": torch.randn(2, 4),
          "transformer.h.0.attn.lora_B.weight": torch.randn(4, 2)}
    flat = json.dumps({"r": 2, "lora_alpha": 4})
    per_component = json.dumps({"transformer.r": 2, "transformer.lora_alpha": 4})
    for name, meta in (("model", flat), ("pipeline", per_component)):
        save_file(sd, tmp_path / f"{name}.safetensors", metadata={"lora_adapter_metadata": meta})
    model_file = load_lora(tmp_path / "model.safetensors")
    assert model_file.format == "peft" and pipeline_components(model_file) == {}
    save_lora(model_file, tmp_path / "model", to="peft")
    config = json.loads((tmp_path / "model" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["transformer.h.0.attn"]

    pipeline_file = load_lora(tmp_path / "pipeline.safetensors")
    assert pipeline_components(pipeline_file) == {"transformer": 1}
    save_lora(pipeline_file, tmp_path / "pipeline", to="peft")
    config = json.loads((tmp_path / "pipeline" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["h.0.attn"]
