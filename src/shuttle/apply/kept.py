"""What ``merge_lora(..., keep=...)`` keeps, and what ``unmerge_lora`` checks before it writes
a kept copy back.

Writing a kept copy back undoes a merge exactly only while the parameter still holds what the
merge wrote; otherwise the copy silently overwrites what came since (another merge, an in-place
edit). Out of order it even resurrects a merge: with kept merges A then B of one weight,
writing A's copy back first discards B, and B's copy (which holds A's merge) then writes A's
merge back for good. So each kept merge leaves a :class:`KeptStamp` in its report, and before
any copy is written back :func:`check_undo` asks of every parameter:

- is it the parameter object the merge wrote (not replaced by another ``nn.Parameter``)?
- is this the newest kept merge of it still in force? Kept merges of a parameter are undone in
  reverse order, as nested ``apply_lora`` scopes exit (:class:`~shuttle.errors.ScopeOrderError`
  otherwise), and never while an open ``apply_lora(mode="merge")`` block holds it merged.
- did nothing write it since? Its autograd version counter (``Tensor._version``: every in-place
  op autograd sees bumps it, and ``merge_lora`` / ``unmerge_lora`` bump it for their own writes,
  which bypass it) must be where the merge left it. Writes through ``.data`` bypass the counter,
  as they bypass autograd's own check, and are not seen. A DTensor's local tensor has its own
  counter; both are compared.

Per parameter object, ``_LIVE`` lists the stamps of its kept merges still in force, oldest
first, weakly: a report that is dropped can no longer undo its merge, which then stays for good
like a merge without ``keep=``. When a merge is undone, the stamp below it expects the version
the write-back left, if nothing wrote the parameter between the two merges.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Mapping

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shuttle.errors import (
    DeviceUnavailableError,
    InvalidOptionError,
    ParameterChangedError,
    ScopeOrderError,
)
from shuttle.weights.dtensor import ShardWindow, sharded

__all__ = ["KeptStamp", "check_undo", "keep_device", "mark_written", "release", "seal",
           "stamp_before"]

Version = tuple[int, ...] | None  # (parameter, DTensor local tensor); None: not tracked

_SEQ = itertools.count()
# parameter -> weak references to the stamps of its kept merges still in force, oldest first
_LIVE: WeakIdKeyDictionary = WeakIdKeyDictionary()

_KEEP_CHOICES = ("keep=True (a copy on the CPU), keep='cuda' or any torch.device (a copy "
                 "there), or keep=False (none)")


class KeptStamp:
    """What a kept merge left each parameter as (see the module docs).

    Attributes:
        seq: the merge's place among all kept merges (later merges have larger ones).
        before: per parameter, its version just before the merge wrote it.
        after: per parameter, the version an undo expects (set when the merge is done).
        windows: per DTensor parameter, the window of the global tensor this rank kept.
        undone: whether :func:`release` has run (the merge was undone).
    """

    def __init__(self, before: dict[str, Version], windows: dict[str, ShardWindow]):
        self.seq = next(_SEQ)
        self.before = before
        self.after: dict[str, Version] = {}
        self.windows = windows
        self.undone = False


def keep_device(keep: object) -> torch.device | None:
    """Where ``merge_lora``'s ``keep=`` puts its copies; None for ``keep=False``.

    Raises:
        InvalidOptionError: ``keep`` is not a bool, a device name or a ``torch.device``, names
            no device, or names the meta device (a copy there holds no values).
        DeviceUnavailableError: the device is one this machine or torch build lacks.
    """
    if keep is False:
        return None
    if keep is True:
        return torch.device("cpu")
    if not isinstance(keep, (str, torch.device)):
        raise InvalidOptionError(f"keep={keep!r}: pass {_KEEP_CHOICES}")
    try:
        device = torch.device(keep)
    except (RuntimeError, ValueError):
        raise InvalidOptionError(f"keep={keep!r} names no device: pass {_KEEP_CHOICES}") from None
    if device.type == "meta":
        raise InvalidOptionError(f"keep={keep!r}: a copy on the meta device holds no values; "
                                 f"pass {_KEEP_CHOICES}")
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    if backend is None or not getattr(backend, "is_available", lambda: False)():
        raise DeviceUnavailableError(
            f"keep={keep!r}: this machine has no {device.type} device (torch "
            f"{torch.__version__} sees none); pass keep=True to keep the copies on the CPU")
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise DeviceUnavailableError(
            f"keep={keep!r}: this machine has {count} {device.type} device(s), "
            f"{device.type}:0..{device.type}:{count - 1}; pass one of those, or keep=True")
    return device


def _version(p: torch.Tensor) -> Version:
    """``p``'s version counter (and its local tensor's, for a DTensor); None for a tensor
    made under ``torch.inference_mode`` (it has none).
    """
    try:
        shard = sharded(p)
        return (p._version,) if shard is None else shard.versions()
    except RuntimeError:
        return None


def stamp_before(params: Mapping[str, torch.Tensor], names: Iterable[str]) -> KeptStamp:
    """A stamp of ``params[names]`` as they are just before a kept merge writes them."""
    names = list(names)
    return KeptStamp({n: _version(params[n]) for n in names},
                     {n: s.window for n in names if (s := sharded(params[n], n)) is not None})


def mark_written(params: Iterable[torch.Tensor]) -> None:
    """Bump the version counter of parameters written in place behind autograd's back
    (through ``.data``, a kernel, a representation's ``write_into``).
    """
    for p in params:
        torch.autograd.graph.increment_version(p)


def seal(stamp: KeptStamp, params: Mapping[str, torch.Tensor]) -> None:
    """Record what the kept merge of ``stamp`` left (after :func:`mark_written`), and list it
    as in force on each of its parameters.
    """
    for name in stamp.before:
        p = params[name]
        stamp.after[name] = _version(p)
        stack = _LIVE.setdefault(p, [])
        stack[:] = [r for r in stack if r() is not None]
        stack.append(weakref.ref(stamp))


def _live(p: torch.Tensor) -> list[KeptStamp]:
    """The stamps of ``p``'s kept merges still in force, oldest first."""
    return [s for s in (r() for r in _LIVE.get(p, ())) if s is not None]


def check_undo(stamp: KeptStamp, params: Mapping[str, torch.Tensor], scoped: set[str],
               force: bool) -> dict[str, str]:
    """Whether writing back the copies of the kept merge of ``stamp`` into ``params`` undoes
    exactly that merge; with ``force``, what the write-back discards instead.

    ``scoped``: the parameters an open ``apply_lora(mode="merge")`` block holds merged.

    Returns:
        Per parameter whose later change the write-back discards (``force`` only), what it was.

    Raises:
        ScopeOrderError: the merge was undone already, an open ``apply_lora`` block holds a
            parameter merged (even with ``force``: its exit would write the merge back), or
            (without ``force``) a later kept merge of a parameter is still in force.
        ParameterChangedError: without ``force``, a parameter was replaced or written since.
    """
    names = list(stamp.before)
    if stamp.undone:
        raise ScopeOrderError(
            f"this merge was undone already (by unmerge_lora); its copies of {_names(names)} "
            "would overwrite what came since. Nothing was written.")
    held = [n for n in names if n in scoped]
    if held:
        raise ScopeOrderError(
            f"{_names(held)} are merged by an apply_lora(mode='merge') block that is still "
            "open: its exit writes back what it copied on entry, this merge included. Exit "
            "that block first, then unmerge. Nothing was written.")
    later: dict[str, str] = {}
    changed: dict[str, str] = {}
    for name in names:
        p = params[name]
        live = _live(p)
        if stamp not in live:
            changed[name] = "replaced by another parameter object"
        elif live[-1] is not stamp:
            later[name] = ("a later kept merge (merge_lora(..., keep=...)), which its report "
                           "can no longer undo")
        elif _version(p) != stamp.after[name]:
            changed[name] = ("written (by an in-place edit, a merge_lora without keep=, or an "
                             "unmerge by subtraction)")
    if force:
        return {**later, **changed}
    if later:
        raise ScopeOrderError(
            f"{_names(later)}: a later kept merge (merge_lora(..., keep=...)) of these is still "
            "in force. Writing this merge's copies back would discard it, and its own undo "
            "would then bring this merge back. Undo kept merges in reverse order "
            "(unmerge_lora(model, later_report) first), subtract this merge instead "
            "(unmerge_lora(model, [(lora, strength), ...])), or pass force=True to write the "
            "copies anyway, discarding the later merge. Nothing was written.")
    if changed:
        shown = "; ".join(f"{n!r} was {w}" for n, w in list(changed.items())[:3])
        more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
        raise ParameterChangedError(
            f"since the merge, {shown}{more}: writing the kept copies back would silently "
            "discard that. Pass force=True to write them "
            "anyway (UnmergeReport.discarded lists what was discarded), or subtract the merge "
            "(unmerge_lora(model, [(lora, strength), ...])). Nothing was written.",
            changed)
    return {}


def release(stamp: KeptStamp, params: Mapping[str, torch.Tensor]) -> None:
    """After the copies of ``stamp``'s merge were written back: bump each parameter's version,
    take the stamp off its list, and let the kept merge below it expect the new version where
    nothing wrote the parameter between that merge and this one.
    """
    stamp.undone = True
    for name in stamp.before:
        p = params[name]
        mark_written([p])
        live = _live(p)
        below = [s for s in live if s.seq < stamp.seq]
        if below and below[-1].after.get(name) == stamp.before[name]:
            below[-1].after[name] = _version(p)
        _LIVE[p] = [weakref.ref(s) for s in live if s is not stamp]


def _names(names: Iterable[str]) -> str:
    """Up to three names, quoted, and how many more."""
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:3])
    return f"{shown} (and {len(names) - 3} more)" if len(names) > 3 else shown
