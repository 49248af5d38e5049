"""Contributions written into one parameter: the float32 (or float64) sum of every update
rounded once to the weight's dtype (:func:`merge_param`), by global draws into a DTensor's
local tensor (:func:`merge_drawn`), or dequantized once and encoded once for float8 and
quantized weights (:func:`merge_encoded`); and the copies that undo such a write
(:func:`copy_param`, :func:`restore_param`). The merge verbs (:mod:`shuttle.apply.merge`) plan
and validate; this module writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from shuttle.apply.fused_jobs import (
    lowrank_sums,
    merge_fused,
)
from shuttle.apply.plan import (
    Contribution,
)
from shuttle.apply.rounding import Rounding, merge_seed, round_to
from shuttle.errors import NonFiniteAdapterError
from shuttle.kernels import triton_available
from shuttle.kernels.rounding import GlobalDraws, round_float
from shuttle.weights import FP8_DTYPES, PLAIN_DTYPES, WeightRepresentation, represent
from shuttle.weights.plain import is_plain_tensor

__all__ = ["apply_contributions", "compute_dtype", "copy_param", "exact_cublas", "merge_drawn",
           "merge_encoded", "merge_param", "restore_param", "write_back"]


def copy_param(p: torch.Tensor, device: torch.device | str | None = None
               ) -> torch.Tensor | WeightRepresentation:
    """A copy of everything a merge rewrites in ``p``, on ``device`` (default: where it is):
    the tensor, or for a quantized weight every storage tensor its representation declares
    (packed data, scales, quant_state). :func:`restore_param` writes it back.
    """
    if is_plain_tensor(p):
        return p.detach().to(device or p.device, copy=True)
    rep = represent(p)
    return dataclasses.replace(rep, **{n: t.to(device or t.device, copy=True)
                                       for n, t in rep.tensors().items()})


def restore_param(p: torch.Tensor, saved: torch.Tensor | WeightRepresentation) -> None:
    """Write a :func:`copy_param` copy back into ``p`` in place, bit for bit."""
    with torch.no_grad():
        if isinstance(saved, WeightRepresentation):
            write_back(p, saved.to(p.device))
        else:
            p.data.copy_(saved)


def merge_param(p: torch.Tensor, name: str, contribs: list[Contribution],
                rounding: Rounding | None = None, seed: int | None = None, *,
                overflow: torch.Tensor | None = None, check: bool = True,
                encoded_seed: int | None = None) -> None:
    """Apply ``contribs`` to parameter ``p`` (named ``name``) with one rounding per element.

    ``rounding=None`` is nearest for float16/bfloat16/float32/float64 and stochastic for float8
    and quantized weights (see :func:`merge_encoded`); stochastic rounding is seeded by
    :func:`~shuttle.apply.rounding.merge_seed` (the name, ``seed`` and ``contribs``).
    ``overflow``: a one-element int32 tensor that the fused kernel path sets to 1 where a
    finite sum rounds to infinity (float16 overflow); the other paths raise instead.
    ``check``: scan the result for NaN and infinity before writing it; False where the update
    is known unable to overflow (:func:`_cannot_fail`), saving a pass over the weight.
    ``encoded_seed``: ``merge_seed(name, seed, contribs)`` computed once by a caller that
    merges the same contributions into fresh copies many times (an offloader's slots), for a
    float8 or quantized ``p``; it spares the small reads of the adapter's fingerprint.
    """
    if not (is_plain_tensor(p) and p.dtype in PLAIN_DTYPES):
        merge_encoded(p, name, contribs, rounding or "stochastic", seed, check, encoded_seed)
        return
    rounding = rounding or "nearest"
    if rounding == "nearest" and merge_fused(p, contribs, overflow):
        return
    w = apply_contributions(p.detach().to(compute_dtype(p.dtype, contribs), copy=True), contribs)
    w = round_to(w, p.dtype, rounding, name, seed, contribs)  # checked after: float16 overflows
    if check and not bool(torch.isfinite(w).all()):
        raise NonFiniteAdapterError(
            f"merging into {name!r} gives NaN or infinity (the update overflows "
            f"{p.dtype}); lower the strength."
        )
    p.data.copy_(w)


def merge_drawn(p: torch.Tensor, name: str, contribs: list[Contribution], draws: GlobalDraws,
                check: bool = True) -> None:
    """:func:`merge_param` into the plain (float8 or 16-bit) local tensor ``p`` of a DTensor,
    rounded stochastically with ``draws`` (by global element index: the same bits on any world
    size). Float8 values beyond the format's finite range clamp to ``±finfo.max``.
    """
    w = apply_contributions(p.detach().to(compute_dtype(p.dtype, contribs), copy=True), contribs)
    if check and not bool(torch.isfinite(w).all()):
        raise NonFiniteAdapterError(
            f"merging into {name!r} gives NaN or infinity; lower the strength.")
    fp8 = p.dtype in FP8_DTYPES
    if fp8:
        fmax = torch.finfo(p.dtype).max
        w = w.clamp_(-fmax, fmax)
    out = round_float(w.float(), p.dtype, "stochastic", noise=draws.uniform(p.shape, p.device))
    if check and not fp8 and not bool(torch.isfinite(out).all()):  # float16 overflow
        raise NonFiniteAdapterError(
            f"merging into {name!r} gives infinity (the update overflows {p.dtype}); lower the "
            "strength.")
    p.data.copy_(out)


def compute_dtype(dtype: torch.dtype, contribs: list[Contribution]) -> torch.dtype:
    """The dtype a merge into a ``dtype`` weight sums in: float64 where the weight or an
    adapter tensor is float64 (a float64 adapter's update is not cut to float32 first), else
    float32.
    """
    if dtype == torch.float64 or any(t.dtype == torch.float64 for c in contribs
                                     for _, t in c.patch.tensors()):
        return torch.float64
    return torch.float32


def apply_contributions(w: torch.Tensor, contribs: list[Contribution]) -> torch.Tensor:
    """``w`` (float32/64, changed in place) with ``contribs`` applied in order, each at its
    planned strength.
    """
    for c in contribs:
        view = w if c.rows is None else w[c.rows[0]:c.rows[1]]
        out = c.patch.apply(view, c.strength)
        if out is not view:
            view.copy_(out)
    return w


def merge_encoded(p: torch.Tensor, name: str, contribs: list[Contribution],
                   rounding: Rounding, seed: int | None, check: bool = True,
                   mixed: int | None = None) -> None:
    """Merge into a float8 or quantized parameter: dequantize to float32 once, apply every
    contribution, encode once (data-dependent scales recomputed), write back in place.

    Float8 values beyond the format's finite range clamp to ``±finfo.max``. The stochastic
    seed is :func:`~shuttle.apply.rounding.merge_seed` of the merge's arguments.
    """
    rep = represent(p.detach() if is_plain_tensor(p) else p)
    if mixed is None:
        mixed = merge_seed(name, seed, contribs) if rounding == "stochastic" else 0
    # Concatenating the factors is work only a representation with a fused kernel uses.
    fused = type(rep).merge_lowrank is not WeightRepresentation.merge_lowrank
    sums = lowrank_sums(contribs) if fused and p.is_cuda and triton_available() else None
    if sums is not None and set(sums) == {None}:
        # A fused kernel of the representation, where it has one: never a dense weight.
        out = rep.merge_lowrank(*sums[None], rounding=rounding, seed=mixed)
        if out is not None:
            write_back(p, out)
            return
    w = apply_contributions(rep.dequantize(), contribs)
    if check and not bool(torch.isfinite(w).all()):
        raise NonFiniteAdapterError(
            f"merging into {name!r} gives NaN or infinity in float32; lower the strength."
        )
    g = torch.Generator(device=p.device)
    g.manual_seed(mixed)
    write_back(p, rep.encode(w, rounding, g))


def write_back(p: torch.Tensor, rep: WeightRepresentation) -> None:
    """Store ``rep`` (of ``p``'s form) into parameter ``p`` in place: the module keeps working
    and every holder of ``p``'s storage tensors sees the new values.

    Each representation writes itself (``write_into``): plain and float8 tensors copy their
    data, the others their packed data and scales (bitsandbytes' quant_state included).
    """
    with torch.no_grad():
        rep.write_into(p)


@contextlib.contextmanager
def exact_cublas() -> Iterator[None]:
    """Keep cuBLAS exact while merging: no bf16/fp16 split-K partial sums, no TF32."""
    m = torch.backends.cuda.matmul
    names = ["allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"]
    exact: dict[str, object] = dict.fromkeys(names, False)
    if hasattr(m, "fp32_precision"):
        exact["fp32_precision"] = "ieee"
    else:
        exact["allow_tf32"] = False
    saved = {k: getattr(m, k) for k in exact}
    for k, v in exact.items():
        setattr(m, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(m, k, v)
