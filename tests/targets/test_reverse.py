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

from shuttle.targets import ModelNames, Split
from tests.targets import cogvideox_layouts, family_layouts, family_layouts_mmdit, \
    ltx_lumina_layouts
from tests.targets.family_oracle import only, shuttle_rows, tagged

pytest.importorskip("diffusers")

# kind -> (build, forward table builder, the reversed family map)
FAMILIES = {
    "wan_t2v": (family_layouts, "wan"),
    "wan_i2v": (family_layouts, "wan"),
}


def _family(kind: str):
    builder, family = FAMILIES[kind]
    module = __import__(f"shuttle.targets.{family}", fromlist=["_"])
    forward = getattr(module, f"{family}_names").__wrapped__
    return builder.build(kind), forward, getattr(module, f"{family}_original_names")


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
