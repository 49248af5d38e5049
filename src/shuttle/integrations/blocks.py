"""Find the block lists worth streaming in a model: lists of like blocks holding a large share
of it.
"""

from __future__ import annotations

import torch

from shuttle.cache.specs import module_bytes

__all__ = ["find_block_lists"]

# A list whose blocks differ streams through slots sized by its largest block: past this ratio
# of largest to smallest the ring would waste more than it streams, and a finer list inside the
# blocks (searched instead) gives a lower floor.
_MAX_SPREAD = 2.0


def find_block_lists(model: torch.nn.Module, min_share: float = 0.1) -> list[str]:
    """Dotted paths of the block lists of ``model`` that should stream.

    A candidate is an ``nn.ModuleList``/``nn.Sequential`` of at least two entries holding
    tensors that either all have the same tensors (names, shapes, dtypes), or are of one class
    and differ in their tensors (T5's ``encoder.block``, whose first block also holds the
    relative attention bias) with the largest at most twice the smallest in bytes: such a list
    streams through one ring of device slots sized by its largest block. The walk stops at the
    outermost candidate (its entries stream whole) and descends into every other module, so a
    list of unlike entries (a UNet's ``down_blocks``) is searched for candidates inside it.
    Candidates holding at least ``min_share`` of the model's bytes are returned, in module
    order.

    Args:
        model: the model (any device; only shapes and dtypes are read).
        min_share: the smallest fraction of the model's tensor bytes a list must hold.

    Returns:
        Paths such as ``["transformer_blocks", "single_transformer_blocks"]``,
        ``["model.layers"]`` or ``["encoder.block"]``; empty when nothing qualifies.
    """
    total = module_bytes(model)
    found: list[str] = []

    def visit(path: str, module: torch.nn.Module) -> None:
        if _streamable(module):
            if total and module_bytes(module) >= min_share * total:
                found.append(path)
            return  # a smaller list inside one entry would stream less
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child)

    visit("", model)
    return found


def _streamable(module: torch.nn.Module) -> bool:
    if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < 2:
        return False
    sizes = [module_bytes(entry) for entry in module]
    if not min(sizes):  # an entry without tensors: nothing to stream
        return False
    if len({_signature(entry) for entry in module}) == 1:
        return True
    return len({type(entry) for entry in module}) == 1 and max(sizes) <= _MAX_SPREAD * min(sizes)


def _signature(module: torch.nn.Module) -> tuple:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return type(module), tuple((n, tuple(t.shape), t.dtype) for n, t in tensors)


