"""Where each row of an adapter's update lands, read from diffusers' converters and from shuttle.

A tagged LoRA has rank 1 and an up factor whose entries name their source: row ``j`` of module
number ``n`` holds ``n * 2**20 + j`` (exact in float64). diffusers' converters rename, split
(``chunk``/``split`` by rows), swap halves and scale by ``alpha / rank`` (1 here); reading the
up factors they return tells which rows of which adapter module each diffusers layer gets.
shuttle's resolution says the same through its targets. The two must agree row for row. The
tensors are small at real size: an up is (out, 1), a down (1, in, k...).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch

import shuttle
from shuttle.targets import FAMILY_MAPS, resolve
from shuttle.targets.family import FamilyMap

ROW_BITS = 2**20


def tagged(layout: dict[str, list[int]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The layout at rank 1 with tagged up factors, and the module names in tag order.

    Alphas become 1 (scale 1 at rank 1). Modules are named by their key before the
    ``.lora_down``/``.lora_up``/``.lora_A``/``.lora_B`` part.
    """
    sd: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    for key, shape in layout.items():
        if shape == []:
            sd[key] = torch.tensor(1.0)
            continue
        module, kind = _split(key)
        if kind == "up":
            n = len(modules)
            modules.append(module)
            rows = torch.arange(shape[0], dtype=torch.float64) + n * ROW_BITS
            sd[key] = rows.reshape(shape[0], 1, *([1] * (len(shape) - 2)))
        else:
            sd[key] = torch.ones(1, *shape[1:], dtype=torch.float64)
    return sd, modules


def _split(key: str) -> tuple[str, str]:
    for marker, kind in ((".lora_up.", "up"), (".lora_B.", "up"), (".lora.up.", "up"),
                         ("_lora.up.", "up"), (".lora_down.", "down"), (".lora_A.", "down"),
                         (".lora.down.", "down"), ("_lora.down.", "down")):
        if marker in key:
            return key.split(marker)[0], kind
    raise KeyError(key)


def decode(up: torch.Tensor, modules: list[str]) -> list[tuple[str, int]]:
    """(source module, source row) for each row of a tagged up factor."""
    tags = up.reshape(up.shape[0], -1)[:, 0].to(torch.int64).tolist()
    return [(modules[t // ROW_BITS], t % ROW_BITS) for t in tags]


def converted_rows(converted: dict[str, torch.Tensor], modules: list[str],
                   strip: tuple[str, ...] = ("transformer.", "unet.")
                   ) -> dict[str, list[tuple[str, int]]]:
    """diffusers module path -> sources of its rows, from a converter's output."""
    out = {}
    for key, value in converted.items():
        if value.ndim < 2:
            continue
        module, kind = _split(key)
        if kind != "up":
            continue
        for p in strip:
            module = module.removeprefix(p)
        out[module.replace(".processor.", ".")] = decode(value, modules)
    return out


def shuttle_rows(sd: dict[str, torch.Tensor], modules: list[str], model: torch.nn.Module
                 ) -> tuple[dict[str, list[tuple[str, int]]], dict[str, str]]:
    """Model module path -> sources of its rows after shuttle's resolution; and the unmatched.

    A layer that got only some rows has None for the others.
    """
    res = resolve(shuttle.load_lora(sd), model)
    shapes = dict((n, p.shape) for n, p in model.named_parameters())
    out: dict[str, list] = {}
    for t in res.targets:
        module = t.param.removesuffix(".weight")
        rows = out.setdefault(module, [None] * shapes[t.param][0])
        start, end = t.rows or (0, shapes[t.param][0])
        rows[start:end] = decode(t.patch.load().up, modules)
    return out, res.unmatched


def meta_state_dict(layout: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """A layout as meta tensors (no memory), with real 0-dim alphas (the loader reads those)."""
    return {k: torch.tensor(8.0) if s == [] else torch.empty(s, dtype=torch.bfloat16,
                                                              device="meta")
            for k, s in layout.items()}


def check_layout(layout: dict[str, list[int]], model: torch.nn.Module) -> dict[str, set[str]]:
    """Resolve a real-size layout: every key lands, every piece fits its rows of its layer.

    Returns:
        adapter module key -> the model modules it reached.
    """
    lora = shuttle.load_lora(meta_state_dict(layout))
    res = resolve(lora, model)
    assert res.unmatched == {}
    shapes = dict((n, p.shape) for n, p in model.named_parameters())
    reached: dict[str, set[str]] = {}
    for t in res.targets:
        shape = shapes[t.param]
        if t.rows is not None:
            shape = torch.Size((t.rows[1] - t.rows[0], *shape[1:]))
        t.patch.check(shape, t.param)
        reached.setdefault(t.module_key, set()).add(t.param.removesuffix(".weight"))
    assert set(reached) == set(lora.modules)
    return reached


@contextlib.contextmanager
def only(family: FamilyMap | None) -> Iterator[None]:
    """Resolve with ``family`` as the only family map (None: all of them, as registered).

    The FLUX.1 table also places the HunyuanVideo keys whose names Flux shares; this shows a
    table complete on its own.
    """
    saved = list(FAMILY_MAPS)
    if family is not None:
        FAMILY_MAPS[:] = [family]
    try:
        yield
    finally:
        FAMILY_MAPS[:] = saved


def tagged_checkpoint(names, table: dict, leaf_name=lambda original, leaf: leaf
                      ) -> tuple[dict[str, torch.Tensor], Callable[[str], torch.Tensor]]:
    """An original-layout checkpoint whose rows carry tags of where the table puts them.

    Row ``j`` of diffusers parameter number ``i`` is tagged ``i * 2**20 + j``; each original
    parameter gets the tags of the rows the table sends it to (split rows included, -1 where
    none). Feeding it to diffusers' own converter must give every parameter its own tags back.

    Returns:
        ``(checkpoint, tags)``: ``tags(param)`` is the expected value of a diffusers parameter.
    """
    from shuttle.targets import Split

    index = {p: i for i, p in enumerate(names.shapes)}

    def tags(param: str) -> torch.Tensor:
        shape = names.shapes[param]
        return torch.arange(shape[0] if shape else 1, dtype=torch.float64) + index[param] * 2**20

    checkpoint = {}
    for original, place in table.items():
        if isinstance(place, str) and place in names.shapes:  # a bare parameter
            checkpoint[original] = tags(place)
            continue
        splits = [Split(place)] if isinstance(place, str) else place
        for leaf in names.modules[splits[0].path]:
            height = max(s.source_rows[1] if s.source_rows else names.shapes[
                f"{s.path}.{leaf}"][0] for s in splits)
            value = torch.full((height,), -1.0, dtype=torch.float64)
            for s in splits:
                a, b = s.source_rows or (0, height)
                value[a:b] = tags(f"{s.path}.{leaf}")[slice(*s.rows) if s.rows else slice(None)]
            checkpoint[f"{original}.{leaf_name(original, leaf)}"] = value
    return checkpoint, tags


def fused_by_diffusers(base: torch.nn.Module, converted: dict[str, torch.Tensor],
                       strength: float, prefix: str | None = "transformer",
                       **load_kwargs) -> torch.nn.Module:
    """A copy of ``base`` with diffusers' own load of ``converted`` fused at ``strength``."""
    expected = copy.deepcopy(base)
    expected.load_lora_adapter(converted, prefix=prefix, **load_kwargs)
    expected.fuse_lora(lora_scale=strength)
    expected.unload_lora()
    return expected


def merged_like(base: torch.nn.Module, sd: dict[str, torch.Tensor], expected: torch.nn.Module,
                strength: float) -> shuttle.apply.MergeReport:
    """``merge_lora`` of ``sd`` on a copy of ``base``: every key lands and every parameter
    equals ``expected``'s (float32 tolerance); returns the report."""
    got = copy.deepcopy(base)
    report = shuttle.merge_lora(got, [(sd, strength)])
    assert report.unmatched == {}
    want = dict(expected.named_parameters())
    for name, p in got.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-5, msg=name)
    return report
