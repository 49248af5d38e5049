"""Rounding a float32 result to the weight's dtype once: to nearest, or stochastically.

Stochastic rounding picks one of the two neighbours of ``x`` in the target dtype with
probability proportional to closeness, so ``E[round(x)] = x``: many small merges do not drift.
Its random stream is seeded from the merge's own arguments (:func:`merge_seed`: the parameter's
name, the contributions merged into it and an optional ``seed``), so a merge gives the same bits
whatever the process merged before, and two different adapters draw different noise. The rounding
itself lives in :mod:`shuttle.kernels.rounding`; this module adds the seeding and the one
default every entry point shares (``rounding=None``): nearest into float16, bfloat16, float32
and float64, where it is the exact result's closest value, and stochastic into float8 and
quantized encodings, whose steps are coarse enough that nearest rounding drops small updates
altogether.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shuttle.errors import InvalidOptionError

# One implementation for every float dtype (float8 included): it steps bit patterns rather than
# calling torch.nextafter, which has no float8 kernel.
from shuttle.kernels.rounding import Rounding, round_float, stochastic_round

if TYPE_CHECKING:
    from shuttle.apply.plan import Contribution

__all__ = ["ROUNDINGS", "Rounding", "check_rounding", "merge_seed", "merge_seeds", "param_seed",
           "round_to", "rounding_for", "stochastic_round"]

ROUNDINGS = ("nearest", "stochastic")
_NEAREST_BY_DEFAULT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_rounding(rounding: object) -> Rounding | None:
    """``rounding`` if it is ``"nearest"``, ``"stochastic"`` or None, else
    :class:`~shuttle.errors.InvalidOptionError`.
    """
    if rounding is not None and rounding not in ROUNDINGS:
        raise InvalidOptionError(
            f"rounding={rounding!r}: expected 'nearest', 'stochastic' or None (the default: "
            "nearest into float16/bfloat16/float32/float64, stochastic into float8 and "
            "quantized weights)")
    return rounding  # type: ignore[return-value]


def rounding_for(rounding: Rounding | None, dtype: torch.dtype) -> Rounding:
    """The rounding into a ``dtype`` value: ``rounding``, or the default for that dtype."""
    if rounding is not None:
        return rounding
    return "nearest" if dtype in _NEAREST_BY_DEFAULT else "stochastic"


def param_seed(name: str, seed: int | None) -> int:
    """A 63-bit seed from a parameter name (CRC32) and an optional user seed."""
    return (zlib.crc32(name.encode()) ^ ((seed or 0) * 0x9E3779B1)) & (2**63 - 1)


# Elements read from each adapter tensor for its fingerprint, evenly spaced.
_SAMPLES = 16


def merge_seed(name: str, seed: int | None, contribs: Sequence[Contribution] = ()) -> int:
    """The 63-bit stochastic-rounding seed of merging ``contribs`` into parameter ``name``.

    A function of the arguments alone: the name and ``seed`` (:func:`param_seed`, all there is
    for a plain dtype conversion), and per contribution its patch kind, scale, strength, rows
    and a fingerprint of each tensor (shape, dtype and ``_SAMPLES`` evenly spaced values, one
    small read per tensor). Merging the same adapters again draws the same noise; pass another
    ``seed`` for other draws.
    """
    return merge_seeds([(name, contribs)], seed)[0]


def merge_seeds(jobs: Sequence[tuple[str, Sequence[Contribution]]],
                seed: int | None) -> list[int]:
    """:func:`merge_seed` of each ``(name, contribs)``, reading every fingerprint's values in
    one transfer per device (a whole-model merge waits for the GPU once, before its launches).
    """
    tensors = {id(t): t for _, contribs in jobs for c in contribs for _, t in c.patch.tensors()}
    values = _samples(list(tensors.values()))
    out = []
    for name, contribs in jobs:
        base = param_seed(name, seed)
        if not contribs:
            out.append(base)
            continue
        h = hashlib.blake2b(base.to_bytes(8, "little"), digest_size=8)
        for c in contribs:
            patch = c.patch
            h.update(repr((patch.kind, getattr(patch, "effective_scale", None), c.strength,
                           c.rows)).encode())
            for key, t in patch.tensors():
                h.update(repr((key, tuple(t.shape), str(t.dtype), values[id(t)])).encode())
        out.append(int.from_bytes(h.digest(), "little") & (2**63 - 1))
    return out


def _samples(tensors: list[torch.Tensor]) -> dict[int, list[float]]:
    """Id -> ``_SAMPLES`` evenly spaced values of each tensor (all of a smaller one), as
    float64 on the host: the same on any device.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    out: dict[int, list[float]] = {}
    for device, group in by_device.items():
        picks = []
        for t in group:
            flat = t.detach().reshape(-1)
            if flat.numel() > _SAMPLES:
                flat = flat[torch.linspace(0, flat.numel() - 1, _SAMPLES,
                                           device=device).long()]
            picks.append(flat.to(torch.float64))
        host = torch.cat(picks).cpu().tolist() if picks else []
        start = 0
        for t, pick in zip(group, picks, strict=True):
            out[id(t)] = host[start:start + pick.numel()]
            start += pick.numel()
    return out


def round_to(x: torch.Tensor, dtype: torch.dtype, rounding: Rounding | None, name: str,
             seed: int | None = None, contribs: Sequence[Contribution] = ()) -> torch.Tensor:
    """``x`` (float32) in ``dtype``, rounded once by ``rounding`` (None: the default for
    ``dtype``, see :func:`rounding_for`); stochastic rounding is seeded by
    :func:`merge_seed` of ``name``, ``seed`` and the ``contribs`` merged into ``x``.
    """
    rounding = rounding_for(rounding, dtype)
    g = None
    if rounding == "stochastic" and dtype not in (torch.float32, torch.float64):
        g = torch.Generator(device=x.device)
        g.manual_seed(merge_seed(name, seed, contribs))
    return round_float(x, dtype, rounding, g)
