"""Permanent merges: fold adapters into a model's weights, validated first, rounded once.

Per parameter the contributions are applied in float32 in order (adapter order, then file
order) and the result is rounded to the weight's dtype once. A float8 or quantized weight
(bitsandbytes, torchao, quanto: any registered representation) is dequantized once and encoded
once, stochastically by default, and written back into the same parameter object. On CUDA, a
parameter whose only contributions are plain low-rank products goes through a fused Triton
kernel (``shuttle.kernels.merge_lowrank``), launched once per group of same-shaped weights: each
weight is read once and written once, the products are accumulated in float32 and rounded once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from shuttle.apply.kept import KeptStamp, keep_device, mark_written, seal, stamp_before
from shuttle.apply.memo import MergeMemo, memo_of
from shuttle.apply.notes import Note, plan_notes
from shuttle.apply.pipeline import Pipeline, as_model
from shuttle.apply.plan import (
    AdapterList,
    Contribution,
    MergePlan,
    check_mergeable,
    plan_params,
)
from shuttle.apply.recipe import MergeRecipe, find_recipe, remember_recipe
from shuttle.apply.rounding import Rounding, check_rounding, merge_seed, merge_seeds, round_to
from shuttle.apply.sharded import agreed, localize, merge_fingerprint, outcome_agreement
from shuttle.apply.widen import narrow, widen_layers
from shuttle.errors import NonFiniteAdapterError, ScopeOrderError, WideningError
from shuttle.kernels import triton_available
from shuttle.kernels.merge_lowrank import (
    RANK_STEPS,
    LowRankJob,
    LowRankMerges,
    merge_lowrank_many,
    overflow_margin,
    replay_merges,
)
from shuttle.kernels.rounding import GlobalDraws, round_float
from shuttle.patches import LowRank
from shuttle.targets import KeyMapping, fused_modules
from shuttle.weights import FP8_DTYPES, PLAIN_DTYPES, WeightRepresentation, represent
from shuttle.weights.plain import is_plain_tensor

__all__ = [
    "MergeReport",
    "apply_contributions",
    "compute_dtype",
    "copy_param",
    "exact_cublas",
    "merge_lora",
    "merge_param",
    "restore_param",
    "merge_plan",
    "LowRankSum",
    "overflow_flag",
    "lowrank_sums",
    "write_back",
]

log = logging.getLogger("shuttle")
_PROGRESS_MIN_PARAMS = 64


@dataclasses.dataclass
class MergeReport:
    """What a merge did.

    Attributes:
        applied: names of the parameters that changed, in merge order.
        unmatched: adapter keys that reached no parameter -> why (prefixed ``source::`` when
            several adapters were merged).
        skipped: adapter keys that were not turned into patches -> why (from ``load_lora``).
        notes: where the update differs on purpose from a peer tool's (:class:`Note`; a kohya
            Flux split-qkv save, scaled per split as trained, is 3x or 4x diffusers' update).
        kept: with ``merge_lora(..., keep=...)``, what the merge overwrote, by parameter name
            (for a DTensor parameter, this rank's shard): :func:`~shuttle.unmerge_lora` puts
            it back bit for bit. None otherwise.
    """

    applied: list[str]
    unmatched: dict[str, str]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: list[Note] = dataclasses.field(default_factory=list)
    kept: dict[str, torch.Tensor | WeightRepresentation] | None = dataclasses.field(
        default=None, repr=False)
    # what the kept merge left each parameter as, for unmerge_lora's checks (apply.kept)
    _stamp: KeptStamp | None = dataclasses.field(default=None, repr=False, compare=False)


def merge_lora(
    model: torch.nn.Module | Pipeline,
    loras: AdapterList,
    *,
    rounding: Rounding | None = None,
    seed: int | None = None,
    mapping: KeyMapping | None = None,
    progress: bool | None = None,
    strict: bool = False,
    keep: bool | str | torch.device = False,
) -> MergeReport:
    """Fold adapters into ``model``'s weights permanently.

    Args:
        model: the model, or a diffusers pipeline (its components; see
            :mod:`shuttle.apply.pipeline`); its parameters change in place.
        loras: ``[(lora, strength), ...]``; each lora a :class:`~shuttle.LoRA` or anything
            :func:`~shuttle.load_lora` reads. A strength of exactly 0 skips that adapter. A
            strength may also be a dict per component, ``{"transformer": 0.8,
            "text_encoder": 0.5}`` (the top-level modules: a pipeline's components), the
            components it does not name at 1 (as diffusers' ``set_adapters`` weights).
        rounding: ``"nearest"``, or ``"stochastic"`` (unbiased; seeded by parameter name and
            ``seed``, so repeatable). Default: nearest for float16/bfloat16/float32 weights,
            stochastic for float8 and quantized weights (bitsandbytes, torchao, quanto; also
            seeded by how many merges the parameter took).
        seed: mixed into the stochastic rounding seed.
        mapping: adapter module key -> model module path (or ``(path, (start, end))``).
        progress: show a progress bar (default: when many parameters change).
        strict: every adapter key must reach a parameter, else
            :class:`~shuttle.errors.UnmatchedKeysError` (listing the keys and why) before any
            change. Without it, unmatched keys are reported (``MergeReport.unmatched``), and a
            merge in which no key lands at all is logged as a warning and warned
            (:class:`UserWarning`).
        keep: keep a copy of every parameter the merge overwrites in the report
            (``MergeReport.kept``), on the CPU for True or on the device given (``"cuda"``, a
            ``torch.device``), so that :func:`~shuttle.unmerge_lora` can undo the merge
            exactly. It costs the memory of those parameters, for as long as the report is
            kept. Kept merges of one parameter are undone in reverse order. On DTensor
            parameters each rank keeps its own shards. (Undoing without it subtracts the
            update, within a rounding or two of the original.)

    Returns:
        A :class:`MergeReport`.

    Raises:
        InvalidStrengthError: a strength is NaN, infinite or not a number.
        InvalidOptionError: ``keep`` is not a bool, a device name or a ``torch.device`` (the
            message lists the choices), or is the meta device.
        DeviceUnavailableError: ``keep`` names a device this machine lacks.
        ShapeMismatchError: an update does not fit its parameter.
        DuplicateTargetError: two keys of one adapter reach the same parameter.
        NonFiniteAdapterError: an adapter tensor holds NaN or infinity.
        UnsupportedLayerError: a parameter cannot take the patch (integer dtype, meta device).
        UnmergeableWeightError: a quantized weight whose encoding cannot be redone (GGUF,
            torchao int4 tile-packed): use ``mode="dynamic"``.
        WideningError: an adapter widens a layer that cannot be widened (see
            :mod:`shuttle.apply.widen`), or widens one with ``keep=``.
        ScopeOrderError: ``keep=`` on a parameter an open ``apply_lora(mode="merge")`` block
            holds merged.
        UnmatchedKeysError: with ``strict``, an adapter key reaches no parameter.
        All of these are raised before any weight changes.

    A merge that overflows a weight's dtype (float16 beyond 65504) is found while merging:
    the parameters this call merged before it are then restored bit for bit and
    ``NonFiniteAdapterError`` is raised, so on any error nothing was changed. For that, each
    parameter whose update could overflow is copied just before its write (float16/bfloat16
    weights whose update bound ``|m s| r max|up| max|down|`` comes near the dtype's overflow
    margin, other patch kinds than plain low-rank, quantized and float8 weights), and those
    are merged first; the copies are dropped when the call returns. The extra memory is at most
    the size of those parameters, none for updates that cannot overflow (the usual case).

    An adapter whose update takes more input features than its ``nn.Linear`` has (a FLUX.1
    control LoRA's ``img_in``) widens the layer for good: its weight gains zero columns, its
    ``in_features`` grows (:mod:`shuttle.apply.widen`); if the merge then fails, the widened
    layers get their original weights back.
    """
    rounding = check_rounding(rounding)
    keep_to = keep_device(keep)
    model = as_model(model)
    params = dict(model.named_parameters())

    def validate() -> tuple[MergePlan, MergePlan, dict[str, torch.Tensor]]:
        plan = plan_params(params, loras, mapping, fused=fused_modules(model), widen=True,
                           strict=strict, memo=memo_of(model))
        # DTensor parameters: their local shards, and the windows of the updates they hold
        local_plan, local = localize(plan, params, rounding=rounding, seed=seed)
        check_mergeable(local_plan, local)
        if keep_to is not None:
            _check_keep(model, plan)
        return plan, local_plan, local

    # every rank of a sharded model validates, and agrees on the merge, before any rank
    # writes (apply.sharded)
    plan, local_plan, local = agreed(params, validate,
                                     lambda r: merge_fingerprint(r[0], rounding, seed))
    kept = _keep(local_plan, local, keep_to)
    stamp = stamp_before(params, local_plan.params) if kept is not None else None
    widened = widen_layers(model, plan, params)  # checks every layer first
    try:
        merge_plan(model, local_plan, rounding=rounding, seed=seed, progress=progress,
                   params=local)
    except BaseException:  # a widened layer that failed goes back to its original weight
        narrow(widened)
        raise
    # the writes went through .data and kernels: bump the version counters, so that an undo
    # of an earlier kept merge sees this one (apply.kept)
    mark_written(params[n] for n in local_plan.params)
    if stamp is not None:
        seal(stamp, params)
    return MergeReport(list(plan.params), plan.unmatched, plan.skipped, plan_notes(plan), kept,
                       stamp)


def _check_keep(model: torch.nn.Module, plan: MergePlan) -> None:
    """Refuse a kept merge whose copies could not undo it.

    Raises:
        WideningError: the plan widens a layer (its original is no plain copy).
        ScopeOrderError: an open ``apply_lora(mode="merge")`` block holds a planned parameter:
            its exit would discard this merge, and the copy (holding the block's merge) would
            then write the block's merge back for good.
    """
    from shuttle.apply.scoped import merged_parameters  # scoped imports this module

    if plan.widen:
        raise WideningError(
            f"keep= with an adapter that widens {sorted(plan.widen)[:3]}: the original layer "
            "cannot be kept as a plain copy; use apply_lora(mode='merge') for a merge that "
            "gives the original layer back")
    held = [n for n in merged_parameters(model) if n in plan.params]
    if held:
        raise ScopeOrderError(
            f"merge_lora(..., keep=...) of {held[:3]}, which an open apply_lora(mode='merge') "
            "block holds merged: the block's exit discards this merge, and undoing it from its "
            "copies would then bring the block's merge back. Merge after the block, or "
            "without keep= (the block's exit undoes it). Nothing was changed.")


def _keep(plan: MergePlan, params: dict[str, torch.Tensor], device: torch.device | None
          ) -> dict[str, torch.Tensor | WeightRepresentation] | None:
    """Copies of the parameters ``plan`` overwrites, on ``device`` (None: no copies)."""
    if device is None:
        return None
    return {name: copy_param(params[name], device) for name in plan.params}


def merge_plan(model: torch.nn.Module, plan: MergePlan, *, rounding: Rounding | None = None,
               seed: int | None = None, progress: bool | None = None,
               params: dict[str, torch.Tensor] | None = None, rollback: bool = True) -> None:
    """Apply a validated :class:`MergePlan` to ``model``'s parameters.

    ``params``: ``dict(model.named_parameters())`` when the caller has it already.
    ``rollback``: copy each parameter whose merge could overflow before writing it, and
    restore those on an overflow (see :func:`merge_lora`); False where the caller restores
    every parameter itself (a scoped merge).

    Raises:
        UnmergeableWeightError: before any write, if a planned parameter cannot be re-encoded.
        NonFiniteAdapterError: a merge overflows its dtype; with ``rollback``, the parameters
            merged before were restored.
    """
    params = params if params is not None else dict(model.named_parameters())
    check_mergeable(plan, params)
    show = progress if progress is not None else len(plan.params) >= _PROGRESS_MIN_PARAMS
    nearest = rounding in (None, "nearest")
    # Sharded over ranks: the ranks agree after the phase that can overflow (below), which a
    # replayed recipe has no place for.
    agree = outcome_agreement(model)
    recipe = find_recipe(memo_of(model), plan, params) if nearest and agree is None else None
    if recipe is not None and recipe.flags:  # an overflow possible: merged in phases instead
        recipe = None
    if recipe is not None:  # the same merge as before: its launches again (see apply.recipe)
        flags = recipe.flags
        for flag in flags.values():
            flag.zero_()
        fused = set(recipe.fused)
        with torch.no_grad(), exact_cublas():
            replay_merges(recipe.launches)
            for name in plan.params:
                if name in plan.draws:
                    merge_drawn(params[name], name, plan.params[name], plan.draws[name])
                elif name not in fused:
                    merge_param(params[name], name, plan.params[name], rounding, seed)
    else:
        flags = _merge_plan(model, plan, params, rounding, seed, show, rollback, agree)
    if any(bool(f) for f in flags.values()):  # not reached: _merge_plan checks its flags
        raise _overflowed(plan, params, flags)


def _overflowed(plan: MergePlan, params: dict[str, torch.Tensor],
                flags: dict[torch.device, torch.Tensor]) -> NonFiniteAdapterError:
    """The error for an overflow the fused kernel flagged (found by a scan of the weights)."""
    bad = [n for n in plan.params if params[n].device in flags
           and params[n].dtype in _FUSED_DTYPES and is_plain_tensor(params[n])
           and not bool(torch.isfinite(params[n]).all())]
    return NonFiniteAdapterError(
        f"merging into {', '.join(repr(n) for n in bad[:3]) or 'a weight'}"
        f"{f' (and {len(bad) - 3} more)' if len(bad) > 3 else ''} gives infinity or NaN "
        f"where the weight was finite (the update overflows its dtype); lower the strength."
    )


_RESTORED = (" Nothing was changed: the parameters this call merged before it was found were "
             "restored.")


def _merge_plan(model: torch.nn.Module, plan: MergePlan, params: dict[str, torch.Tensor],
                rounding: Rounding | None, seed: int | None,
                show: bool, rollback: bool = True,
                agree: Callable[[BaseException | None], None] | None = None
                ) -> dict[torch.device, torch.Tensor]:
    """:func:`merge_plan`'s work where no recipe repeats it; returns the overflow flags, and
    remembers the launches as a recipe where they can be repeated (:mod:`shuttle.apply.recipe`).

    Parameters whose merge could overflow (:func:`_cannot_fail` false) are merged first, each
    copied just before its write (with ``rollback``); their overflow flags are read once
    after them, and any failure among them restores the copies. The rest cannot fail by
    overflow: they are merged after, without a finiteness check and without a copy. On a
    sharded model, ``agree`` (every rank calls it once, with its outcome of that first phase)
    has the ranks learn whether any of them failed: then every rank restores its copies, so
    an overflow on one rank's shard leaves no rank merged.
    """
    # Per device, one overflow flag that the fused kernel sets and this reads once after
    # the risky parameters (the kernel path cannot stop before a write without a host sync per
    # weight); none, and no sync, where no update can overflow its weight.
    flags: dict[torch.device, torch.Tensor] = {}
    nearest = rounding in (None, "nearest")
    # Weights the fused kernel takes are launched in groups of same-shaped weights as they
    # come (LowRankMerges): one launch per weight cost more host time than the GPU's merge.
    merges = LowRankMerges(record=nearest)
    fused_names = []
    safe = {n: _cannot_fail(params[n], cs, plan.memo) for n, cs in plan.params.items()}
    seeds = _encoded_seeds(plan, params, rounding, seed)
    risky = [n for n in plan.params if not safe[n]]
    backups: dict[str, torch.Tensor | WeightRepresentation] = {}

    def merge_one(name: str) -> None:
        p, contribs = params[name], plan.params[name]
        if rollback and not safe[name]:
            backups[name] = copy_param(p)
        bar.update()
        if name in plan.draws:
            merge_drawn(p, name, contribs, plan.draws[name], check=not safe[name])
            return
        fused = _fused_jobs(p, contribs) if nearest else None
        if fused is None:
            merge_param(p, name, contribs, rounding, seed, check=not safe[name],
                        encoded_seed=seeds.get(name))
            return
        overflow = overflow_flag(p, contribs, flags, plan.memo)
        if overflow is not None:
            fused = [job._replace(overflow=overflow) for job in fused]
        fused_names.append(name)
        for job in fused:
            if job.w is not p or not _plain_factors(job, contribs):
                merges.stop_recording()  # a view or a copy: see apply.recipe
            merges.add(job)

    with torch.no_grad(), exact_cublas(), \
            tqdm(total=len(plan.params), desc="merging", unit="param", disable=not show) as bar:
        try:
            failed: BaseException | None = None
            try:
                for name in risky:
                    merge_one(name)
            except Exception as e:  # noqa: BLE001 - raised below, once the ranks agree
                if agree is None:
                    raise
                failed = e
            _end_risky_phase(plan, params, flags, merges, agree, failed)
            for name in plan.params:
                if safe[name]:
                    merge_one(name)
        except BaseException as e:
            merges.flush()  # launches queued before the failure complete, then are undone
            for name, saved in backups.items():
                restore_param(params[name], saved)
            if isinstance(e, NonFiniteAdapterError) and backups:
                raise NonFiniteAdapterError(f"{e}{_RESTORED}") from e
            raise
        merges.flush()
    if merges.launches and not flags:  # a recipe replays without phases: only overflow-free
        recipe = MergeRecipe(plan, params, fused_names, merges.launches, flags)
        remember_recipe(memo_of(model), recipe, plan.adapters)
    return flags


def _end_risky_phase(plan: MergePlan, params: dict[str, torch.Tensor],
                     flags: dict[torch.device, torch.Tensor], merges: LowRankMerges,
                     agree: Callable[[BaseException | None], None] | None,
                     error: BaseException | None) -> None:
    """After the parameters that may overflow (``error``: what one of them raised): one sync
    for their flags (before any parameter without a copy), then, sharded, the ranks' agreement
    on the outcome.

    Raises:
        NonFiniteAdapterError: a merge of this rank overflowed (or ``error``).
        RankFailedError: another rank's did (sharded).
    """
    if error is None and flags:
        merges.flush()
        if any(bool(f) for f in flags.values()):
            error = _overflowed(plan, params, flags)
    if agree is not None:
        agree(error)  # raises error here, RankFailedError on the ranks where nothing failed
    if error is not None:
        raise error


def _encoded_seeds(plan: MergePlan, params: dict[str, torch.Tensor], rounding: Rounding | None,
                   seed: int | None) -> dict[str, int]:
    """The stochastic seeds of the float8 and quantized parameters, all read before the first
    launch (:func:`~shuttle.apply.rounding.merge_seeds`: one wait for the GPU, not one a
    parameter between launches).
    """
    if rounding == "nearest":
        return {}
    names = [n for n in plan.params
             if not (is_plain_tensor(params[n]) and params[n].dtype in PLAIN_DTYPES)]
    return dict(zip(names, merge_seeds([(n, plan.params[n]) for n in names], seed),
                    strict=True))


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


# Beyond the kernel's margins (float16, bfloat16): how far past the largest finite value a
# float32 or float64 sum may go and still round to it (half an ulp at the top).
_WIDE_MARGIN = {torch.float32: 2.0 ** 103, torch.float64: 2.0 ** 970}


def _cannot_fail(p: torch.Tensor, contribs: list[Contribution], memo: MergeMemo) -> bool:
    """Whether merging ``contribs`` into ``p`` provably cannot overflow: a plain weight of a
    plain dtype, plain low-rank contributions whose bound (as in :func:`_cannot_overflow`) is
    below the dtype's margin. A weight that already holds NaN or infinity then keeps it; no
    other merge can make a value non-finite. Quantized and float8 weights, and other patch
    kinds, are never known safe.
    """
    if not (is_plain_tensor(p) and p.dtype in PLAIN_DTYPES):
        return False
    margin = overflow_margin(p.dtype) or _WIDE_MARGIN.get(p.dtype)
    return margin is not None and _update_bound(contribs, memo) * 2 < margin


def _plain_factors(job: LowRankJob, contribs: list[Contribution]) -> bool:
    """Whether ``job`` merges one contribution by the adapter's own factors, as the kernel
    takes them (no concatenated or zero-padded copy for a recipe to keep alive).
    """
    return len(contribs) == 1 and job.seg[1] in RANK_STEPS and job.up.is_contiguous() \
        and job.down.is_contiguous()


def merge_param(p: torch.Tensor, name: str, contribs: list[Contribution],
                rounding: Rounding | None = None, seed: int | None = None, *,
                overflow: torch.Tensor | None = None, check: bool = True,
                encoded_seed: int | None = None) -> None:
    """Apply ``contribs`` to parameter ``p`` (named ``name``) with one rounding per element.

    ``rounding=None`` is nearest for float16/bfloat16/float32/float64 and stochastic for float8
    and quantized weights (see :func:`_merge_encoded`); stochastic rounding is seeded by
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
        _merge_encoded(p, name, contribs, rounding or "stochastic", seed, check, encoded_seed)
        return
    rounding = rounding or "nearest"
    if rounding == "nearest" and _merge_fused(p, contribs, overflow):
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


def apply_contributions(w: torch.Tensor, contribs: list[Contribution],
                        strengths: Sequence[float] | None = None) -> torch.Tensor:
    """``w`` (float32/64, changed in place) with ``contribs`` applied in order.

    ``strengths``, if given, replaces each contribution's strength by ``strengths[c.adapter]``
    (a dynamic adapter whose strength changed after planning).
    """
    for c in contribs:
        view = w if c.rows is None else w[c.rows[0]:c.rows[1]]
        out = c.patch.apply(view, c.strength if strengths is None else strengths[c.adapter])
        if out is not view:
            view.copy_(out)
    return w


def _merge_encoded(p: torch.Tensor, name: str, contribs: list[Contribution],
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


class LowRankSum(NamedTuple):
    """Plain low-rank contributions to one row range, concatenated along the rank:
    the update is ``sum_i alpha[i] * up[:, seg[i]:seg[i+1]] @ down[seg[i]:seg[i+1]]``.
    """

    up: torch.Tensor  # (rows, R)
    down: torch.Tensor  # (R, N)
    seg: list[int]
    alpha: list[float]


def lowrank_sums(contribs: list[Contribution]
                 ) -> dict[tuple[int, int] | None, LowRankSum] | None:
    """Per row range (None: the whole weight), the contributions as one :class:`LowRankSum`;
    None where a fused kernel cannot take them (another patch kind, Tucker or transposed
    factors, mixed factor dtypes, or a whole-weight and a row-range update together).
    """
    if len(contribs) == 1:  # the common case: no grouping by rows, no concatenation
        c = contribs[0]
        patch = c.patch
        if not _plain_lowrank(patch):
            return None
        up, down = patch.factors()
        if up.dtype != down.dtype or up.dtype == torch.float64:  # the kernels sum in float32
            return None
        return {c.rows: LowRankSum(up, down, [0, down.shape[0]],
                                   [c.strength * patch.effective_scale])}
    groups: dict[tuple[int, int] | None, list[Contribution]] = {}
    factor_dtypes = set()
    for c in contribs:
        patch = c.patch
        if not _plain_lowrank(patch):
            return None
        factor_dtypes |= {patch.up.dtype, patch.down.dtype}
        groups.setdefault(c.rows, []).append(c)
    if len(factor_dtypes) != 1 or torch.float64 in factor_dtypes \
            or (None in groups and len(groups) > 1):
        return None
    sums = {}
    for rows, cs in groups.items():
        ups, downs = zip(*(c.patch.factors() for c in cs), strict=True)
        seg = [0]
        for d in downs:
            seg.append(seg[-1] + d.shape[0])
        one = len(cs) == 1  # no concatenation (a copy) for the usual single adapter
        sums[rows] = LowRankSum(ups[0] if one else torch.cat(ups, dim=1),
                                downs[0] if one else torch.cat(downs, dim=0), seg,
                                [c.strength * c.patch.effective_scale for c in cs])
    return sums


def _merge_fused(p: torch.Tensor, contribs: list[Contribution],
                 overflow: torch.Tensor | None = None) -> bool:
    """The single-pass CUDA path; returns False (doing nothing) where it does not apply."""
    jobs = _fused_jobs(p, contribs, overflow)
    if jobs is None:
        return False
    merge_lowrank_many(jobs)
    return True


def _fused_jobs(p: torch.Tensor, contribs: list[Contribution],
                overflow: torch.Tensor | None = None) -> list[LowRankJob] | None:
    """The fused kernel's jobs for ``p``, or None where that kernel does not apply.

    Plain low-rank contributions are concatenated along the rank per row range, for the fused
    Triton kernel: W read once, written once, one rounding. Not for float64 weights (the
    kernel accumulates in float32), quantized weights, nor weights off the kernel device.
    """
    if not _kernel_takes(p):
        return None
    sums = lowrank_sums(contribs)
    if sums is None:
        return None
    # the parameter itself when 2-D (no new tensor object: host time per weight counts here)
    w2d = p if p.dim() == 2 else p.detach().view(p.shape[0], -1)
    return [LowRankJob(w2d if rows is None else w2d[rows[0]:rows[1]], *lr, overflow)
            for rows, lr in sums.items()]


def overflow_flag(p: torch.Tensor, contribs: list[Contribution],
                  flags: dict[torch.device, torch.Tensor], memo: MergeMemo | None = None
                  ) -> torch.Tensor | None:
    """The flag for :func:`merge_param`'s ``overflow``: ``p``'s device's one in ``flags``
    (created at its first use), or None where the fused kernel does not take ``p`` or its
    patches (the other paths raise on overflow themselves) or the update cannot overflow the
    weight (the kernel then skips the check, a fifth of its time, and the caller a sync).
    ``memo``: where the finite check left the adapter tensors' maxima (None: not measured).
    """
    if not (_kernel_takes(p) and all(_plain_lowrank(c.patch) for c in contribs)) \
            or _cannot_overflow(p.dtype, contribs, memo):
        return None
    flag = flags.get(p.device)
    if flag is None:
        flag = flags[p.device] = torch.zeros(1, dtype=torch.int32, device=p.device)
    return flag


def _cannot_overflow(dtype: torch.dtype, contribs: list[Contribution],
                     memo: MergeMemo | None) -> bool:
    """Whether the update is too small to carry any finite weight of ``dtype`` past its
    overflow threshold: ``|update| <= sum_i |m_i s_i| r_i max|up_i| max|down_i|`` (each
    element of ``up @ down`` sums r products), from the maxima the finite check measured,
    against :func:`overflow_margin` with a factor 2 to spare for float32 rounding. False
    where it cannot tell (a patch other than a plain low-rank product, an unmeasured tensor).
    """
    margin = overflow_margin(dtype)
    if margin is None:
        return True
    return _update_bound(contribs, memo) * 2 < margin


def _update_bound(contribs: list[Contribution], memo: MergeMemo | None) -> float:
    """``sum_i |m_i s_i| r_i max|up_i| max|down_i|``, a bound on every element of the update;
    infinity where it cannot tell (another patch kind, an unmeasured tensor).
    """
    if memo is None:
        return math.inf
    bound = 0.0
    for c in contribs:
        if not _plain_lowrank(c.patch):
            return math.inf
        up, down = memo.known_abs_max(c.patch.up), memo.known_abs_max(c.patch.down)
        if up is None or down is None:
            return math.inf
        bound += abs(c.strength * c.patch.effective_scale) * c.patch.rank * up * down
    return bound


# The fused kernel accumulates in float32: float64 weights take the float64 path.
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _kernel_takes(p: torch.Tensor) -> bool:
    """Whether the fused kernel can merge into parameter ``p`` (its patches aside)."""
    return (p.dtype in _FUSED_DTYPES and is_plain_tensor(p) and _on_kernel_device(p)
            and p.dim() >= 2 and p.is_contiguous() and triton_available())


def _plain_lowrank(patch: object) -> bool:
    """A low-rank product the fused kernel takes: no Tucker core, factors not transposed."""
    return isinstance(patch, LowRank) and patch.mid is None and not patch.transposed


def _on_kernel_device(p: torch.Tensor) -> bool:
    """Whether ``p`` lives where the merge kernels run (CUDA; tests add the interpreter)."""
    return p.is_cuda


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
