"""Permanent merges: fold adapters into a model's weights, validated first, rounded once.

Per parameter the contributions are applied in float32 in order (adapter order, then file
order) and the result is rounded to the weight's dtype once. A float8 or quantized weight
(bitsandbytes, torchao, quanto: any registered representation) is dequantized once and encoded
once, stochastically by default, and written back into the same parameter object. On CUDA, a
parameter whose only contributions are plain low-rank products goes through a fused Triton
kernel (``shuttle.kernels.merge_lowrank``), launched once per group of same-shaped weights: each
weight is read once and written once, the products are accumulated in float32 and rounded once.

This module holds the verbs (validate, then write, with rollback and the ranks' agreements);
one parameter's write is :mod:`shuttle.apply.param_merge`, the fused kernel's jobs
:mod:`shuttle.apply.fused_jobs`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from shuttle.apply.checks import check_mergeable
from shuttle.apply.fused_jobs import (
    FUSED_DTYPES,
    fused_jobs,
    overflow_flag,
    update_bound,
)
from shuttle.apply.kept import KeptStamp, keep_device, mark_written, seal, stamp_before
from shuttle.apply.memo import MergeMemo, memo_of
from shuttle.apply.notes import Note, plan_notes
from shuttle.apply.param_merge import (
    copy_param,
    exact_cublas,
    merge_drawn,
    merge_param,
    restore_param,
)
from shuttle.apply.pipeline import Pipeline, as_model
from shuttle.apply.plan import (
    AdapterList,
    Contribution,
    MergePlan,
    plan_params,
)
from shuttle.apply.recipe import MergeRecipe, find_recipe, remember_recipe
from shuttle.apply.rounding import Rounding, check_rounding, merge_seeds
from shuttle.apply.sharded import agreed, localize, merge_fingerprint, outcome_agreement
from shuttle.apply.widen import narrow, widen_layers
from shuttle.errors import NonFiniteAdapterError, ScopeOrderError, WideningError
from shuttle.kernels.merge_lowrank import (
    RANK_STEPS,
    LowRankJob,
    LowRankMerges,
    overflow_margin,
    replay_merges,
)
from shuttle.targets import KeyMapping, fused_modules, transposed_modules
from shuttle.weights import PLAIN_DTYPES, WeightRepresentation
from shuttle.weights.plain import is_plain_tensor

__all__ = ["MergeReport", "merge_lora", "merge_plan"]

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
        rounding: ``"nearest"``, or ``"stochastic"`` (unbiased; seeded from the arguments
            alone, :func:`~shuttle.apply.rounding.merge_seed`: the parameter's name, ``seed``
            and the contributions merged into it, so the same merge gives the same bits
            whatever was merged before). Default: nearest for float16/bfloat16/float32
            weights, stochastic for float8 and quantized weights (bitsandbytes, torchao,
            quanto).
        seed: mixed into the stochastic rounding seed; another value, other draws.
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
        plan = plan_params(params, loras, mapping, fused=fused_modules(model),
                           transposed=transposed_modules(model), widen=True, strict=strict,
                           memo=memo_of(model))
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
    from shuttle.apply.open_scopes import merged_parameters

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
           and params[n].dtype in FUSED_DTYPES and is_plain_tensor(params[n])
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
        fused = fused_jobs(p, contribs) if nearest else None
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


# Beyond the kernel's margins (float16, bfloat16): how far past the largest finite value a
# float32 or float64 sum may go and still round to it (half an ulp at the top).
_WIDE_MARGIN = {torch.float32: 2.0 ** 103, torch.float64: 2.0 ** 970}


def _cannot_fail(p: torch.Tensor, contribs: list[Contribution], memo: MergeMemo) -> bool:
    """Whether merging ``contribs`` into ``p`` provably cannot overflow: a plain weight of a
    plain dtype, plain low-rank contributions whose bound (as in :func:`cannot_overflow`) is
    below the dtype's margin. A weight that already holds NaN or infinity then keeps it; no
    other merge can make a value non-finite. Quantized and float8 weights, and other patch
    kinds, are never known safe.
    """
    if not (is_plain_tensor(p) and p.dtype in PLAIN_DTYPES):
        return False
    margin = overflow_margin(p.dtype) or _WIDE_MARGIN.get(p.dtype)
    return margin is not None and update_bound(contribs, memo) * 2 < margin


def _plain_factors(job: LowRankJob, contribs: list[Contribution]) -> bool:
    """Whether ``job`` merges one contribution by the adapter's own factors, as the kernel
    takes them (no concatenated or zero-padded copy for a recipe to keep alive).
    """
    return len(contribs) == 1 and job.seg[1] in RANK_STEPS and job.up.is_contiguous() \
        and job.down.is_contiguous()
