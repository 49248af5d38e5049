"""Split adapter modules onto a model's fused projection (q, k, v onto one qkv weight).

An adapter trained on separate ``to_q``/``to_k``/``to_v`` layers applies to a model that stores
them as one ``to_qkv`` weight by giving each its rows of the fused output: rows are stacked in
group order, each as tall as that split's output features.

A model may also hold both: diffusers' ``fuse_qkv_projections()`` adds ``to_qkv`` beside the
``to_q``/``to_k``/``to_v`` it was built from, and the forward reads only ``to_qkv``. There
:func:`live_fused` gives a split layer's update its rows of the fused layer as well.
"""

from __future__ import annotations

from shuttle.targets.names import ModelNames

__all__ = ["FUSED_GROUPS", "fused_candidates", "live_fused"]

# (split leaf names in row order, fused leaf names a model may use)
FUSED_GROUPS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("to_q", "to_k", "to_v"), ("to_qkv", "qkv")),
    (("to_k", "to_v"), ("to_kv",)),  # diffusers' fused cross-attention (to_q stays apart)
    (("q_proj", "k_proj", "v_proj"), ("qkv_proj", "in_proj", "qkv")),
    (("q", "k", "v"), ("qkv",)),
    (("query", "key", "value"), ("query_key_value", "qkv")),
    (("add_q_proj", "add_k_proj", "add_v_proj"), ("add_qkv_proj", "to_added_qkv")),
    (("gate_proj", "up_proj"), ("gate_up_proj",)),
    (("w1", "w3"), ("w13",)),
)


def fused_candidates(path: str, sep: str = ".") -> list[tuple[str, int, tuple[str, ...]]]:
    """For a split module ``path``, ``(fused_path, index, group)`` for every fused spelling.

    ``sep`` is the separator before the leaf (``"_"`` for kohya names).
    """
    out = []
    for group, fused_names in FUSED_GROUPS:
        for index, leaf in enumerate(group):
            if path == leaf or path.endswith(sep + leaf):
                parent = path[: -len(leaf)]
                out.extend((parent + fused, index, group) for fused in fused_names)
    return out


def live_fused(path: str, names: ModelNames) -> tuple[str, int, int] | str | None:
    """Where the forward computes split module ``path`` if its parent runs fused projections.

    Returns:
        None when the forward runs ``path`` itself (its parent is not in ``names.fused``, or
        has no fused layer for it); else ``(fused path, first row, rows)``, the rows of the
        fused weight that stand for ``path``, found from the heights of the split layers
        beside it; or a reason string when those heights do not stack to the fused weight.
    """
    parent = path.rpartition(".")[0]
    if parent not in names.fused:
        return None
    prefix = f"{parent}." if parent else ""
    for fused, index, group in fused_candidates(path):
        weight = names.param(fused, "weight")
        if weight is None:
            continue
        split = [names.param(prefix + leaf, "weight") for leaf in group]
        heights = [names.shapes[w][0] for w in split if w is not None]
        if len(heights) != len(group) or sum(heights) != names.shapes[weight][0]:
            return (f"the model runs it fused into {fused!r}, whose rows are not "
                    f"{' + '.join(group)}; pass mapping={{...}}")
        return fused, sum(heights[:index]), heights[index]
    return None
