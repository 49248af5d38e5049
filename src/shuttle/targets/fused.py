"""Split adapter modules onto a model's fused projection (q, k, v onto one qkv weight).

An adapter trained on separate ``to_q``/``to_k``/``to_v`` layers applies to a model that stores
them as one ``to_qkv`` weight by giving each its rows of the fused output: rows are stacked in
group order, each as tall as that split's output features.
"""

from __future__ import annotations

__all__ = ["FUSED_GROUPS", "fused_candidates"]

# (split leaf names in row order, fused leaf names a model may use)
FUSED_GROUPS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("to_q", "to_k", "to_v"), ("to_qkv", "qkv")),
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
