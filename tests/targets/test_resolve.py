"""Unit tests of :func:`shuttle.resolve` on small real modules."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import shuttle
from shuttle.errors import DuplicateTargetError, ShapeMismatchError
from shuttle.formats import LoRA
from shuttle.patches import Diff, LowRank
from shuttle.targets import ModelNames, resolve
from tests import close

RANK = 2


def tree(layers: dict[str, nn.Module]) -> nn.Module:
    """A module whose submodule at each dotted path is the given layer."""
    root = nn.Module()
    for path, layer in layers.items():
        *parents, leaf = path.split(".")
        node = root
        for name in parents:
            if not hasattr(node, name):
                node.add_module(name, nn.Module())
            node = getattr(node, name)
        node.add_module(leaf, layer)
    return root


def lin(i: int = 4, o: int = 4, bias: bool = True) -> nn.Linear:
    return nn.Linear(i, o, bias=bias)


def lowrank(out: int = 4, inp: int = 4) -> LowRank:
    return LowRank("weight", up=torch.randn(out, RANK), down=torch.randn(RANK, inp),
                   scale=1.0)


def lora_of(spec: dict[str, tuple[int, int]]) -> LoRA:
    """A LoRA with one low-rank patch of (out, in) per module key."""
    return LoRA("test", {k: [lowrank(*shape)] for k, shape in spec.items()})


def placed(res) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """module key -> (parameter, rows) of its weight patch."""
    return {t.module_key: (t.param, t.rows) for t in res.targets}


def check_shapes(res, model: nn.Module) -> None:
    shapes = ModelNames.of(model).shapes
    for t in res.targets:
        shape = shapes[t.param]
        if t.rows is not None:
            shape = torch.Size((t.rows[1] - t.rows[0], *shape[1:]))
        t.patch.check(shape, t.param)


BLOCK = "blocks.0.attn.to_q"


# -- prefixes ------------------------------------------------------------------------------------


def test_exact_name():
    model = tree({BLOCK: lin()})
    res = resolve(lora_of({BLOCK: (4, 4)}), model)
    assert placed(res) == {BLOCK: (f"{BLOCK}.weight", None)}
    assert res.unmatched == {}


@pytest.mark.parametrize("prefix", ["base_model.model.", "diffusion_model.", "transformer.",
                                    "unet.", "model.", "model.diffusion_model.",
                                    "text_encoder."])
def test_adapter_prefix_stripped(prefix):
    model = tree({BLOCK: lin()})
    res = resolve(lora_of({prefix + BLOCK: (4, 4)}), model)
    assert placed(res) == {prefix + BLOCK: (f"{BLOCK}.weight", None)}
    assert res.unmatched == {}


@pytest.mark.parametrize("root", ["transformer", "unet", "diffusion_model", "model",
                                  "text_encoder"])
def test_model_root_added(root):
    model = tree({f"{root}.{BLOCK}": lin()})
    res = resolve(lora_of({BLOCK: (4, 4)}), model)
    assert placed(res) == {BLOCK: (f"{root}.{BLOCK}.weight", None)}


@pytest.mark.parametrize(("key_prefix", "root"), [
    ("transformer.", "diffusion_model"),
    ("base_model.model.", "transformer"),
    ("diffusion_model.", "unet"),
    ("base_model.model.transformer.", "transformer"),
])
def test_prefix_swapped_for_model_root(key_prefix, root):
    model = tree({f"{root}.{BLOCK}": lin()})
    res = resolve(lora_of({key_prefix + BLOCK: (4, 4)}), model)
    assert placed(res) == {key_prefix + BLOCK: (f"{root}.{BLOCK}.weight", None)}


def test_exact_name_wins_over_stripped():
    # The model has both a top-level "proj_out" and "transformer.proj_out".
    model = tree({"proj_out": lin(), "transformer.proj_out": lin()})
    res = resolve(lora_of({"transformer.proj_out": (4, 4)}), model)
    assert placed(res) == {"transformer.proj_out": ("transformer.proj_out.weight", None)}


def test_processor_segment_dropped():
    model = tree({"unet.mid_block.attn1.to_q": lin()})
    sd = {"unet.mid_block.attn1.processor.to_q_lora.up.weight": torch.randn(4, RANK),
          "unet.mid_block.attn1.processor.to_q_lora.down.weight": torch.randn(RANK, 4)}
    lora = shuttle.load_lora(sd)
    res = resolve(lora, model)
    assert placed(res) == {"unet.mid_block.attn1.processor.to_q":
                           ("unet.mid_block.attn1.to_q.weight", None)}


def test_bare_parameter_target():
    model = nn.Module()
    model.pos_embed = nn.Parameter(torch.zeros(3, 4))
    lora = LoRA("test", {"pos_embed": [Diff("weight", diff=torch.ones(3, 4))]})
    res = resolve(lora, model)
    assert placed(res) == {"pos_embed": ("pos_embed", None)}


def test_model_given_as_names_or_shapes():
    model = tree({f"transformer.{BLOCK}": lin()})
    lora = lora_of({BLOCK: (4, 4)})
    expected = placed(resolve(lora, model))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    assert placed(resolve(lora, shapes)) == expected
    assert placed(resolve(lora, ModelNames(shapes))) == expected


# -- kohya names ---------------------------------------------------------------------------------


def test_kohya_underscored_names_built_forward():
    model = tree({"img_attn.to_q": lin(), "double_blocks.0.img_attn.qkv": lin(4, 12),
                  "single_blocks.0.linear1": lin()})
    keys = {"lora_unet_img_attn_to_q": (4, 4),
            "lora_unet_double_blocks_0_img_attn_qkv": (12, 4),
            "lora_unet_single_blocks_0_linear1": (4, 4)}
    res = resolve(lora_of(keys), model)
    assert placed(res) == {
        "lora_unet_img_attn_to_q": ("img_attn.to_q.weight", None),
        "lora_unet_double_blocks_0_img_attn_qkv": ("double_blocks.0.img_attn.qkv.weight", None),
        "lora_unet_single_blocks_0_linear1": ("single_blocks.0.linear1.weight", None),
    }
    assert res.unmatched == {}


@pytest.mark.parametrize("prefix", ["lora_transformer_", "lora_unet_"])
def test_kohya_names_below_component_root(prefix):
    model = tree({"transformer.transformer_blocks.0.attn.to_q": lin(),
                  "text_encoder.encoder.layers.0.q_proj": lin()})
    key = f"{prefix}transformer_blocks_0_attn_to_q"
    res = resolve(lora_of({key: (4, 4)}), model)
    assert placed(res) == {key: ("transformer.transformer_blocks.0.attn.to_q.weight", None)}


def test_kohya_same_spelling_of_two_paths_is_ambiguous():
    model = tree({"img_attn.to_q": lin(), "img.attn_to_q": lin()})
    res = resolve(lora_of({"lora_unet_img_attn_to_q": (4, 4)}), model)
    assert res.targets == []
    reason = res.unmatched["lora_unet_img_attn_to_q"]
    assert "ambiguous" in reason
    assert "'img_attn.to_q'" in reason and "'img.attn_to_q'" in reason


def _two_text_encoders() -> nn.Module:
    te = "encoder.layers.0.q_proj"
    return tree({f"text_encoder.{te}": lin(), f"text_encoder_2.{te}": lin(),
                 "unet.down.proj": lin()})


@pytest.mark.parametrize(("prefix", "component"), [
    ("lora_te1_", "text_encoder."),
    ("lora_te_", "text_encoder."),
    ("lora_te2_", "text_encoder_2."),
])
def test_kohya_te_prefix_chooses_component(prefix, component):
    res = resolve(lora_of({f"{prefix}encoder_layers_0_q_proj": (4, 4)}), _two_text_encoders())
    assert res.unmatched == {}
    assert placed(res) == {f"{prefix}encoder_layers_0_q_proj":
                           (f"{component}encoder.layers.0.q_proj.weight", None)}


def test_kohya_te_and_unet_in_one_adapter():
    lora = lora_of({"lora_te1_encoder_layers_0_q_proj": (4, 4),
                    "lora_te2_encoder_layers_0_q_proj": (4, 4),
                    "lora_unet_down_proj": (4, 4)})
    res = resolve(lora, _two_text_encoders())
    assert res.unmatched == {}
    assert sorted(p for p, _ in placed(res).values()) == [
        "text_encoder.encoder.layers.0.q_proj.weight",
        "text_encoder_2.encoder.layers.0.q_proj.weight",
        "unet.down.proj.weight",
    ]


def test_kohya_te_prefix_without_its_component_is_ambiguous():
    # lora_te3_ names neither encoder; both are plausible, so the key is not guessed.
    res = resolve(lora_of({"lora_te3_encoder_layers_0_q_proj": (4, 4)}), _two_text_encoders())
    assert res.targets == []
    assert "ambiguous" in res.unmatched["lora_te3_encoder_layers_0_q_proj"]


def test_kohya_unet_prefix_never_lands_in_text_encoder():
    res = resolve(lora_of({"lora_unet_encoder_layers_0_q_proj": (4, 4)}), _two_text_encoders())
    assert res.targets == []
    assert "no module" in res.unmatched["lora_unet_encoder_layers_0_q_proj"]


def test_dotted_name_in_two_text_encoders_is_ambiguous():
    res = resolve(lora_of({"encoder.layers.0.q_proj": (4, 4)}), _two_text_encoders())
    assert res.targets == []
    reason = res.unmatched["encoder.layers.0.q_proj"]
    assert "ambiguous" in reason and "text_encoder_2.encoder.layers.0.q_proj" in reason


@pytest.mark.parametrize("key", [
    "lora_te1_text_model_encoder_layers_0_q_proj",
    "text_encoder.text_model.encoder.layers.0.q_proj",
])
def test_clip_text_model_level_dropped(key):
    """transformers 5's CLIPTextModel has no ``text_model.`` level; adapters still spell it."""
    res = resolve(lora_of({key: (4, 4)}), _two_text_encoders())
    assert res.unmatched == {}
    assert placed(res) == {key: ("text_encoder.encoder.layers.0.q_proj.weight", None)}


def test_clip_text_model_level_kept_when_model_has_it():
    model = tree({"text_encoder.text_model.encoder.layers.0.q_proj": lin()})
    res = resolve(lora_of({"lora_te1_text_model_encoder_layers_0_q_proj": (4, 4)}), model)
    assert placed(res) == {"lora_te1_text_model_encoder_layers_0_q_proj":
                           ("text_encoder.text_model.encoder.layers.0.q_proj.weight", None)}


# -- split q/k/v onto a fused projection ---------------------------------------------------------


@pytest.mark.parametrize(("split", "fused"), [
    (("to_q", "to_k", "to_v"), "to_qkv"),
    (("to_q", "to_k", "to_v"), "qkv"),
    (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (("q_proj", "k_proj", "v_proj"), "in_proj"),
    (("add_q_proj", "add_k_proj", "add_v_proj"), "to_added_qkv"),
])
def test_split_qkv_onto_fused_rows(split, fused):
    model = tree({f"blocks.0.attn.{fused}": lin(4, 24)})
    keys = {f"transformer.blocks.0.attn.{leaf}": (8, 4) for leaf in split}
    res = resolve(lora_of(keys), model)
    assert res.unmatched == {}
    param = f"blocks.0.attn.{fused}.weight"
    assert placed(res) == {
        f"transformer.blocks.0.attn.{split[0]}": (param, (0, 8)),
        f"transformer.blocks.0.attn.{split[1]}": (param, (8, 16)),
        f"transformer.blocks.0.attn.{split[2]}": (param, (16, 24)),
    }
    check_shapes(res, model)


def test_split_qkv_kohya_onto_fused_rows():
    model = tree({"blocks.0.attn.to_qkv": lin(4, 24)})
    keys = {f"lora_unet_blocks_0_attn_{leaf}": (8, 4) for leaf in ("to_q", "to_k", "to_v")}
    res = resolve(lora_of(keys), model)
    assert res.unmatched == {}
    assert {k: r for k, (_, r) in placed(res).items()} == {
        "lora_unet_blocks_0_attn_to_q": (0, 8),
        "lora_unet_blocks_0_attn_to_k": (8, 16),
        "lora_unet_blocks_0_attn_to_v": (16, 24),
    }


def test_gate_up_onto_fused_rows():
    model = tree({"mlp.gate_up_proj": lin(4, 12)})
    res = resolve(lora_of({"mlp.gate_proj": (6, 4), "mlp.up_proj": (6, 4)}), model)
    assert placed(res) == {"mlp.gate_proj": ("mlp.gate_up_proj.weight", (0, 6)),
                           "mlp.up_proj": ("mlp.gate_up_proj.weight", (6, 12))}


def test_split_qkv_unequal_sizes_gqa():
    # 8 query rows, 4 key rows, 4 value rows (grouped-query attention).
    model = tree({"attn.qkv_proj": lin(4, 16)})
    keys = {"attn.q_proj": (8, 4), "attn.k_proj": (4, 4), "attn.v_proj": (4, 4)}
    res = resolve(lora_of(keys), model)
    assert res.unmatched == {}
    assert placed(res) == {"attn.q_proj": ("attn.qkv_proj.weight", (0, 8)),
                           "attn.k_proj": ("attn.qkv_proj.weight", (8, 12)),
                           "attn.v_proj": ("attn.qkv_proj.weight", (12, 16))}
    check_shapes(res, model)


def test_split_qkv_partial_group_equal_thirds():
    model = tree({"attn.to_qkv": lin(4, 24)})
    res = resolve(lora_of({"attn.to_v": (8, 4)}), model)
    assert placed(res) == {"attn.to_v": ("attn.to_qkv.weight", (16, 24))}


def test_split_qkv_partial_group_unequal_sizes_unmatched():
    # Without v, the rows of q and k in a 16-row GQA projection cannot be told apart.
    model = tree({"attn.qkv_proj": lin(4, 16)})
    res = resolve(lora_of({"attn.q_proj": (8, 4), "attn.k_proj": (4, 4)}), model)
    assert res.targets == []
    assert set(res.unmatched) == {"attn.q_proj", "attn.k_proj"}
    assert all("cannot tell which rows" in r for r in res.unmatched.values())


def test_separate_layers_preferred_over_fused():
    model = tree({"attn.to_q": lin(), "attn.to_qkv": lin(4, 12)})
    res = resolve(lora_of({"attn.to_q": (4, 4)}), model)
    assert placed(res) == {"attn.to_q": ("attn.to_q.weight", None)}


# -- caller mapping ------------------------------------------------------------------------------


def test_mapping_dict():
    model = tree({BLOCK: lin(), "blocks.0.attn.to_k": lin()})
    lora = lora_of({"weird.name": (4, 4), BLOCK: (4, 4)})
    res = resolve(lora, model, mapping={"weird.name": "blocks.0.attn.to_k"})
    assert placed(res) == {"weird.name": ("blocks.0.attn.to_k.weight", None),
                           BLOCK: (f"{BLOCK}.weight", None)}


def test_mapping_overrides_builtin_rules():
    model = tree({BLOCK: lin(), "blocks.0.attn.to_k": lin()})
    res = resolve(lora_of({BLOCK: (4, 4)}), model, mapping={BLOCK: "blocks.0.attn.to_k"})
    assert placed(res) == {BLOCK: ("blocks.0.attn.to_k.weight", None)}


def test_mapping_dict_with_rows():
    model = tree({"attn.fused": lin(4, 12)})
    lora = lora_of({"a": (8, 4), "b": (4, 4)})
    res = resolve(lora, model, mapping={"a": ("attn.fused", (0, 8)),
                                        "b": ("attn.fused", (8, 12))})
    assert placed(res) == {"a": ("attn.fused.weight", (0, 8)),
                           "b": ("attn.fused.weight", (8, 12))}
    assert res.unmatched == {}
    check_shapes(res, model)


def test_mapping_callable_with_rows_and_fallback():
    model = tree({"attn.fused": lin(4, 12), BLOCK: lin()})
    lora = lora_of({"lora_x": (6, 4), "lora_y": (6, 4), BLOCK: (4, 4)})

    def mapping(key):
        return {"lora_x": ("attn.fused", (0, 6)), "lora_y": ("attn.fused", [6, 12])}.get(key)

    res = resolve(lora, model, mapping=mapping)
    assert placed(res) == {"lora_x": ("attn.fused.weight", (0, 6)),
                           "lora_y": ("attn.fused.weight", (6, 12)),
                           BLOCK: (f"{BLOCK}.weight", None)}


def test_mapping_to_missing_module_reported():
    model = tree({BLOCK: lin()})
    res = resolve(lora_of({BLOCK: (4, 4)}), model, mapping={BLOCK: "no.such.layer"})
    assert res.targets == []
    assert "'no.such.layer'" in res.unmatched[BLOCK]


# -- reports -------------------------------------------------------------------------------------


def test_unknown_key_reported():
    model = tree({BLOCK: lin()})
    res = resolve(lora_of({BLOCK: (4, 4), "transformer.nothing.here": (4, 4),
                           "lora_unet_nothing_here": (4, 4)}), model)
    assert placed(res) == {BLOCK: (f"{BLOCK}.weight", None)}
    assert set(res.unmatched) == {"transformer.nothing.here", "lora_unet_nothing_here"}
    assert all("no module of the model matches" in r for r in res.unmatched.values())


def test_bias_patch_on_biasless_layer_reported():
    model = tree({"proj": lin(bias=False), "proj_b": lin(bias=True)})
    sd = {}
    for m in ("proj", "proj_b"):
        sd[f"{m}.lora_A.weight"] = torch.randn(RANK, 4)
        sd[f"{m}.lora_B.weight"] = torch.randn(4, RANK)
        sd[f"{m}.lora_B.bias"] = torch.randn(4)
    res = resolve(shuttle.load_lora(sd), model)
    assert sorted((t.module_key, t.param) for t in res.targets) == [
        ("proj", "proj.weight"), ("proj_b", "proj_b.bias"), ("proj_b", "proj_b.weight")]
    assert list(res.unmatched) == ["proj (bias)"]
    assert "no parameter 'bias'" in res.unmatched["proj (bias)"]


# -- duplicates ----------------------------------------------------------------------------------


@pytest.mark.parametrize("other", [f"transformer.{BLOCK}", "lora_unet_blocks_0_attn_to_q",
                                   f"base_model.model.{BLOCK}"])
def test_two_keys_onto_one_parameter(other):
    model = tree({BLOCK: lin()})
    with pytest.raises(DuplicateTargetError, match="both update parameter"):
        resolve(lora_of({BLOCK: (4, 4), other: (4, 4)}), model)


def test_fused_and_split_keys_overlap():
    model = tree({"attn.to_qkv": lin(4, 12)})
    with pytest.raises(DuplicateTargetError, match="overlapping rows"):
        resolve(lora_of({"attn.to_qkv": (12, 4), "attn.to_q": (4, 4)}), model)


def test_mapping_rows_overlap():
    model = tree({"attn.fused": lin(4, 12)})
    with pytest.raises(DuplicateTargetError):
        resolve(lora_of({"a": (8, 4), "b": (8, 4)}), model,
                mapping={"a": ("attn.fused", (0, 8)), "b": ("attn.fused", (4, 12))})


def test_mapping_onto_taken_parameter():
    model = tree({BLOCK: lin()})
    with pytest.raises(DuplicateTargetError):
        resolve(lora_of({BLOCK: (4, 4), "other": (4, 4)}), model, mapping={"other": BLOCK})


def test_layers_peft_wrapped_take_the_update_in_their_base_layer():
    """A PeftModel (or a diffusers model after load_lora_weights) keeps each targeted layer's
    weight at ``<layer>.base_layer.weight``: the layer's own name reaches it, the report says
    PEFT's adapter is there too, and the model's output is the base output plus both."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = nn.Sequential()
    model.q, model.k = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(3, 8)
    g = torch.Generator().manual_seed(1)
    sd = {f"{n}.lora_{p}.weight": torch.randn(*s, generator=g)
          for n in ("q", "k") for p, s in (("A", (2, 8)), ("B", (8, 2)))}
    want_q = model.q.weight.detach() + sd["q.lora_B.weight"] @ sd["q.lora_A.weight"]
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q"], init_lora_weights=False))
    report = shuttle.merge_lora(peft, [(sd, 1.0)])
    assert report.unmatched == {}
    assert sorted(report.applied) == ["base_model.model.k.weight",
                                      "base_model.model.q.base_layer.weight"]
    # float32 rounding of the merge: within an ulp of W + B @ A (the BLAS may fold W into
    # the product's accumulation)
    close(peft.base_model.model.q.base_layer.weight, want_q, rtol=1e-6, atol=1e-6)
    assert [(n.kind, n.keys) for n in report.notes] == [("peft-wrapped", ("q",))]
    with peft.disable_adapter():  # PEFT's own adapter off: shuttle's update alone
        torch.testing.assert_close(peft.base_model.model.q(x), x @ want_q.T + model.q.bias)


@pytest.mark.parametrize(("rows", "why"), [
    ((6, 14), "rows 6:14 of 'attn.fused.weight': past the tensor's 12 rows"),
    ((12, 16), "rows 12:16 of 'attn.fused.weight': past the tensor's 12 rows"),
    ((8, 4), "rows 8:4 of 'attn.fused.weight': an empty or reversed range"),
    ((-2, 4), "rows -2:4 of 'attn.fused.weight': an empty or reversed range"),
])
def test_mapping_rows_past_the_tensor_say_so(rows, why):
    """Not "overlapping rows": a range past the end also overlaps a neighbour's or the whole
    tensor's, and the duplicate check would name the wrong mistake."""
    model = tree({"attn.fused": lin(4, 12)})
    lora = lora_of({"a": (8, 4), "b": (max(rows[1] - rows[0], 1), 4), "whole": (12, 4)})
    for mapping in ({"a": ("attn.fused", (0, 8)), "b": ("attn.fused", rows)},
                    {"whole": "attn.fused", "b": ("attn.fused", rows)}):
        with pytest.raises(ShapeMismatchError, match=re.escape(why)):
            resolve(lora, model, mapping=mapping)
