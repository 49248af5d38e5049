"""The test suite. Shared helpers live here (imported as ``from tests import ...``); test modules
mirror the package tree.

``lowrank_state``: PEFT-keyed low-rank factors for named modules, from one seeded generator.
"""

from __future__ import annotations

import torch


def lowrank_state(shapes: dict[str, tuple[int, int]], rank: int = 4, scale: float = 0.1,
                  seed: int = 5, generator: torch.Generator | None = None
                  ) -> dict[str, torch.Tensor]:
    """``<module>.lora_A.weight`` (rank, in) and ``.lora_B.weight`` (out, rank) per module of
    ``shapes`` (``module -> (out, in)``), drawn A then B, module by module, scaled by ``scale``.

    ``generator``, if given, is drawn from (and advanced) instead of a new one seeded ``seed``.
    """
    g = generator or torch.Generator().manual_seed(seed)
    sd = {}
    for m, (out_f, in_f) in shapes.items():
        sd[f"{m}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * scale
        sd[f"{m}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * scale
    return sd
