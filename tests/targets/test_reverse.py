"""Diffusers-named adapters on models that keep their family's original names.

Each family's forward table (original name -> diffusers place) is checked against diffusers' own
converters in the family's test module. Here the other direction is checked against that table:
a meta model in the original layout is built from it (each original module holding the
diffusers layers it stands for, fused rows stacked as the table splits them), a tagged adapter
in diffusers' names is resolved onto it, and every row of every original layer must carry the
adapter row that the forward table sends there. Every Linear and conv the table places, at real
size.
"""

from __future__ import annotations

import pytest
import torch

import shuttle
from shuttle.targets import ModelNames, Split
from shuttle.targets.family_table import invert
from tests.targets import (
    cogvideox_layouts,
    family_layouts,
    family_layouts_mmdit,
    ltx_lumina_layouts,
)
from tests.targets.family_oracle import only, shuttle_rows, tagged
from tests.targets.test_hunyuan_video import tiny_hunyuan_video
from tests.targets.test_sd3 import tiny_sd35

pytest.importorskip("diffusers")

# kind -> (the test module that builds it, its family)
FAMILIES = {
    "sdxl": (family_layouts, "sd_unet"),
    "sd15": (family_layouts, "sd_unet"),
    "wan_t2v": (family_layouts, "wan"),
    "wan_i2v": (family_layouts, "wan"),
    "hunyuan_video": (family_layouts, "hunyuan_video"),
    "sd3_medium": (family_layouts_mmdit, "sd3"),
    "sd35_large": (family_layouts_mmdit, "sd3"),
    "sd35_medium": (family_layouts_mmdit, "sd3"),
    "chroma": (family_layouts_mmdit, "chroma"),
    "flux": (family_layouts_mmdit, "flux"),
    "lumina2": (ltx_lumina_layouts, "lumina2"),
    "z_image": (ltx_lumina_layouts, "z_image"),
    "cogvideox_2b": (cogvideox_layouts, "cogvideox"),
    "cogvideox_5b": (cogvideox_layouts, "cogvideox"),
    "ltxv_13b": (ltx_lumina_layouts, "ltx_video"),
}
# the module of each family map, where its name is not the family's
MODULES = {"z_image": "lumina2"}


def _family(kind: str):
    builder, family = FAMILIES[kind]
    module = __import__(f"shuttle.targets.{MODULES.get(family, family)}", fromlist=["_"])
    forward = getattr(module, f"{family}_names").__wrapped__
    return builder.build(kind), forward, getattr(module, f"{family}_original_names")


def original_state(state: dict[str, torch.Tensor], table: dict) -> dict[str, torch.Tensor]:
    """A diffusers model's ``state`` as the original layout's parameters (fused rows stacked
    as the table splits them; rows no split fills are NaN)."""
    names = ModelNames({n: t.shape for n, t in state.items()})
    out = {}
    for original, place in table.items():
        if isinstance(place, str) and place in state:
            out[original] = state[place].clone()
            continue
        splits = [Split(place)] if isinstance(place, str) else place
        for leaf in names.modules[splits[0].path]:
            first = state[f"{splits[0].path}.{leaf}"]
            height = max(s.source_rows[1] if s.source_rows else
                         state[f"{s.path}.{leaf}"].shape[0] for s in splits)
            value = torch.full((height, *first.shape[1:]), torch.nan, dtype=first.dtype)
            for s in splits:
                rows = state[f"{s.path}.{leaf}"][slice(*s.rows) if s.rows else slice(None)]
                value[slice(*s.source_rows) if s.source_rows else slice(None)] = rows
            renamed = dict((m, a) for a, m in splits[0].params).get(leaf, leaf)
            out[f"{original}.{renamed}"] = value
    return out


def original_model(names: ModelNames, table: dict, root: str = "") -> torch.nn.Module:
    """A meta model whose parameters are the table's original modules under ``root``, shaped
    from the places the table gives them (a fused original stacks its splits' rows).
    """
    params: dict[str, torch.Size] = {}
    for original, place in table.items():
        if isinstance(place, str) and place in names.shapes:  # a bare parameter
            params[root + original] = names.shapes[place]
            continue
        splits = [Split(place)] if isinstance(place, str) else place
        for leaf in names.modules[splits[0].path]:
            shape = names.shapes[f"{splits[0].path}.{leaf}"]
            height = max(s.source_rows[1] if s.source_rows else
                         names.shapes[f"{s.path}.{leaf}"][0] for s in splits)
            renamed = dict((m, a) for a, m in splits[0].params).get(leaf, leaf)
            params[f"{root}{original}.{renamed}"] = torch.Size((height, *shape[1:]))
    model = torch.nn.Module()
    for name, shape in params.items():
        *path, leaf = name.split(".")
        module = model
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, device="meta")))
    return model


# A model in a ComfyUI-style wrapper keeps its names under a root.
CASES = [(kind, "") for kind in sorted(FAMILIES)] + [("wan_i2v", "model.diffusion_model.")]


@pytest.mark.parametrize(("kind", "root"), CASES)
def test_diffusers_adapter_lands_on_the_original_layout(kind, root):
    model, forward, reversed_map = _family(kind)
    names = ModelNames.of(model)
    table = forward(names)
    layers = {n: m.weight.shape for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear | torch.nn.Conv2d | torch.nn.Conv3d)}
    # what rows of which diffusers layer each original row should get, from the forward table
    expected: dict[str, list] = {}
    for original, place in table.items():
        splits = [Split(place)] if isinstance(place, str) else place
        if not all(s.path in layers for s in splits):
            continue
        height = max(s.source_rows[1] if s.source_rows else layers[s.path][0] for s in splits)
        rows = expected.setdefault(original, [None] * height)
        for s in splits:
            a, b = s.source_rows or (0, height)
            r = range(*s.rows) if s.rows else range(layers[s.path][0])
            rows[a:b] = [(f"transformer.{s.path}", j) for j in r]
    placed = {s.path for o in expected for s in
              ([Split(table[o])] if isinstance(table[o], str) else table[o])}
    expected = {root + o: rows for o, rows in expected.items()}
    layout = {}
    for path in sorted(placed):
        shape = list(layers[path])
        layout[f"transformer.{path}.lora_A.weight"] = [4, *shape[1:]]
        layout[f"transformer.{path}.lora_B.weight"] = [shape[0], 4, *[1] * (len(shape) - 2)]
    sd, modules = tagged(layout)
    with only(reversed_map):
        got, unmatched = shuttle_rows(sd, modules, original_model(names, table, root))
    assert unmatched == {}
    assert got == expected


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_the_reverse_table_is_the_forward_table_turned_around(kind):
    """Each family declares its correspondence once; the table a model in the original layout
    gets (its names respelled the diffusers way, the forward table built on those) is exactly
    the forward table of the diffusers model inverted: every place, every row band, every
    parameter rename, and nothing more.
    """
    model, forward, reversed_map = _family(kind)
    names = ModelNames.of(model)
    table = forward(names)
    original = ModelNames.of(original_model(names, table))
    assert reversed_map.__wrapped__(original) == invert(table, "")


@pytest.mark.parametrize("kind", ["hunyuan_video", "sd3"])
def test_a_diffusers_file_merges_into_the_original_layout_as_diffusers_fuses_it(kind, tmp_path):
    """A LoRA trained with PEFT on the diffusers model and saved by the pipeline's
    ``save_lora_weights``, merged into the original layout by shuttle, equals diffusers'
    ``fuse_lora`` on the diffusers model, row for row through the family's table."""
    from diffusers import HunyuanVideoPipeline, StableDiffusion3Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    base = tiny_hunyuan_video() if kind == "hunyuan_video" else tiny_sd35()
    family = "hunyuan_video" if kind == "hunyuan_video" else "sd3"
    module = __import__(f"shuttle.targets.{family}", fromlist=["_"])
    table = getattr(module, f"{family}_names").__wrapped__(ModelNames.of(base))
    original = original_model(ModelNames.of(base), table)
    original.load_state_dict(original_state(base.state_dict(), table), assign=True)

    linears = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)]
    base.add_adapter(LoraConfig(r=4, lora_alpha=6, target_modules=linears,
                                init_lora_weights=False))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    pipeline = HunyuanVideoPipeline if kind == "hunyuan_video" else StableDiffusion3Pipeline
    pipeline.save_lora_weights(  # as diffusers' training scripts save: alpha in the metadata
        tmp_path, transformer_lora_layers=get_peft_model_state_dict(base),
        transformer_lora_adapter_metadata=base.peft_config["default"].to_dict())
    base.fuse_lora(lora_scale=0.7)
    base.unload_lora()

    report = shuttle.merge_lora(original, [(tmp_path / "pytorch_lora_weights.safetensors", 0.7)])
    assert report.unmatched == {}
    want = original_state(base.state_dict(), table)
    got = dict(original.named_parameters())
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, equal_nan=True,
                                   msg=name)
