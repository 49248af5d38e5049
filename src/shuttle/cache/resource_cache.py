"""``ResourceCache``: built resources under one byte budget, with leases and eviction.

Every entry is charged its bytes against ``max_bytes``. Admitting an entry first reserves its
estimate (evicting unleased entries chosen by the policy), then builds it without the lock
held, then charges its exact bytes (evicting more if the estimate was low). A leased entry is
never evicted; the lock is held only for bookkeeping, never while a lease is in use or a value
is built. The cache never moves bytes itself: it builds, counts and drops references.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from shuttle.byte_count import ByteCount, byte_count
from shuttle.cache.policy import CacheEntry, EvictionContext, EvictionPolicy, LRUEvictionPolicy
from shuttle.cache.specs import Spec
from shuttle.errors import (
    CacheError,
    DuplicateResourceKeyError,
    EvictionPolicyError,
    ResourceLeasedError,
    ResourceNotRegisteredError,
    ResourceTooLargeError,
)

__all__ = ["CacheEntry", "CacheInfo", "ResourceCache"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheInfo:
    """A consistent snapshot of the whole cache (taken under one lock).

    Attributes:
        max_bytes: the budget.
        used_bytes: bytes charged; always the sum of ``entries``' ``nbytes``.
        entries: every entry, building ones included.
    """

    max_bytes: int
    used_bytes: int
    entries: tuple[CacheEntry, ...]


class _Entry:
    """The cache's mutable record of one resource (guarded by the cache lock)."""

    __slots__ = ("key", "spec", "value", "nbytes", "leases", "state", "last_used", "uses")

    def __init__(self, key: Hashable, spec: Spec, nbytes: int, leases: int, stamp: int):
        self.key = key
        self.spec = spec
        self.value: Any = None
        self.nbytes = nbytes
        self.leases = leases
        self.state: Literal["building", "ready"] = "building"
        self.last_used = stamp
        self.uses = leases

    def snapshot(self) -> CacheEntry:
        return CacheEntry(self.key, self.nbytes, self.leases, self.state, self.last_used,
                          self.uses)


def _is_spec(x: object) -> bool:
    return hasattr(x, "build") and hasattr(x, "key") and hasattr(x, "estimated_bytes")


def _same_spec(a: object, b: object) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # e.g. specs holding tensors: only the same object counts as the same
        return False


def _check_max(max_bytes: object) -> int:
    return byte_count(max_bytes, "max_bytes", CacheError)


class ResourceCache:
    """Built resources under a byte budget; leased ones are never evicted.

    Thread-safe: any method may be called from any thread.

    Args:
        max_bytes: the budget, in bytes (or as :func:`~shuttle.byte_count.byte_count` reads
            it: ``6e9``, ``"16GiB"``).
        policy: chooses victims among unleased entries (default :class:`LRUEvictionPolicy`).

    Raises:
        CacheError: ``max_bytes`` is not a number of bytes >= 0.
    """

    def __init__(self, max_bytes: ByteCount, policy: EvictionPolicy | None = None):
        self._max = _check_max(max_bytes)
        self._policy: EvictionPolicy = policy if policy is not None else LRUEvictionPolicy()
        self._entries: dict[Hashable, _Entry] = {}
        self._used = 0
        self._clock = itertools.count(1)
        self._cond = threading.Condition(threading.Lock())

    # -- reading ---------------------------------------------------------------------------
    @property
    def max_bytes(self) -> int:
        """The budget, in bytes."""
        return self._max

    @property
    def used_bytes(self) -> int:
        """Bytes charged: every entry's bytes (estimates for entries being built)."""
        with self._cond:
            return self._used

    @property
    def available_bytes(self) -> int:
        """``max_bytes - used_bytes``."""
        with self._cond:
            return self._max - self._used

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy."""
        return self._policy

    def __contains__(self, key: Hashable) -> bool:
        with self._cond:
            return key in self._entries

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    def keys(self) -> list[Hashable]:
        """The keys of every entry (building ones included), oldest admission first."""
        with self._cond:
            return list(self._entries)

    def info(self, key: Hashable) -> CacheEntry:
        """A snapshot of the entry under ``key``.

        Raises:
            ResourceNotRegisteredError: no entry has this key.
        """
        with self._cond:
            return self._get_locked(key).snapshot()

    def snapshot(self) -> CacheInfo:
        """The budget, the bytes used and every entry, all read at one instant."""
        with self._cond:
            return CacheInfo(self._max, self._used,
                             tuple(e.snapshot() for e in self._entries.values()))

    # -- admitting and leasing -------------------------------------------------------------
    def register(self, spec: Spec) -> CacheEntry:
        """Build ``spec`` and admit it, evicting unleased entries as the policy chooses.

        Returns:
            A snapshot of the new entry.

        Raises:
            DuplicateResourceKeyError: ``spec.key`` is registered already.
            ResourceTooLargeError: the entry does not fit even after evicting every unleased
                entry (nothing is evicted then).
            EvictionPolicyError: the policy's answer was invalid (nothing is evicted).
            Whatever ``spec.build()`` raises (the reservation is returned).
        """
        with self._cond:
            entry, dropped = self._reserve_locked(spec, leases=0)
        del dropped  # evicted values are released here, outside the lock
        self._build(entry)
        with self._cond:
            return entry.snapshot()

    @contextlib.contextmanager
    def lease(self, spec_or_key: Spec | Hashable) -> Iterator[Any]:
        """Hold an entry for the ``with`` block (it cannot be evicted); yields its value.

        A spec that is not registered yet is built and admitted first (as by ``register``).
        If another thread is building the same key, this waits for it.

        Raises:
            ResourceNotRegisteredError: a key (not a spec) that names no entry.
            DuplicateResourceKeyError: a spec whose key is registered with a different spec.
            ResourceTooLargeError, EvictionPolicyError: admitting a new spec failed.
        """
        entry = self._acquire(spec_or_key)
        try:
            yield entry.value
        finally:
            self._release(entry)

    # -- removing --------------------------------------------------------------------------
    def evict(self, key: Hashable) -> int:
        """Drop the entry under ``key``; returns the bytes freed.

        Raises:
            ResourceNotRegisteredError: no entry has this key.
            ResourceLeasedError: the entry is leased or being built.
        """
        with self._cond:
            entry = self._get_locked(key)
            if entry.leases or entry.state != "ready":
                raise ResourceLeasedError(
                    f"cannot evict {key!r}: it is {self._busy(entry)}; leave the lease's "
                    "`with` block (or wait for the build) first")
            self._remove_locked(entry)
        logger.info("evicted %r (%d bytes) on request", key, entry.nbytes)
        return entry.nbytes

    def clear(self) -> int:
        """Drop every entry that is built and not leased; returns the bytes freed.

        Leased and building entries stay (they are in use).
        """
        with self._cond:
            dropped = [e for e in self._entries.values() if e.state == "ready" and not e.leases]
            for e in dropped:
                self._remove_locked(e)
        freed = sum(e.nbytes for e in dropped)
        logger.info("cleared %d entries (%d bytes)", len(dropped), freed)
        del dropped  # the values are released here, outside the lock
        return freed

    def resize(self, max_bytes: ByteCount) -> None:
        """Change the budget; shrinking evicts unleased entries as the policy chooses.

        Raises:
            CacheError: ``max_bytes`` is not a number of bytes >= 0.
            ResourceTooLargeError: leased and building entries alone exceed ``max_bytes``
                (``required`` is their bytes); nothing is evicted and the budget is unchanged.
            EvictionPolicyError: the policy's answer was invalid (nothing changed).
        """
        max_bytes = _check_max(max_bytes)
        with self._cond:
            dropped = self._free_locked(self._used - max_bytes, max_bytes,
                                        f"resize to {max_bytes} bytes")
            self._max = max_bytes
        del dropped

    # -- internals (the caller holds the lock where the name says so) -----------------------
    def _get_locked(self, key: Hashable) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise ResourceNotRegisteredError(
                f"no cache entry has key {key!r}; register(spec) it, or lease a spec instead "
                f"of its key (keys now: {list(self._entries)[:8]})")
        return entry

    @staticmethod
    def _busy(entry: _Entry) -> str:
        return "being built" if entry.state != "ready" else f"leased ({entry.leases} leases)"

    def _acquire(self, spec_or_key: Spec | Hashable) -> _Entry:
        is_spec = _is_spec(spec_or_key)
        key = spec_or_key.key if is_spec else spec_or_key  # type: ignore[union-attr]
        with self._cond:
            while (entry := self._entries.get(key)) is not None:
                if is_spec and not _same_spec(entry.spec, spec_or_key):
                    raise DuplicateResourceKeyError(
                        f"key {key!r} is registered with another spec ({entry.spec!r}); give "
                        "this one its own key, or evict the old entry first")
                if entry.state == "ready":
                    entry.leases += 1
                    entry.uses += 1
                    entry.last_used = next(self._clock)
                    return entry
                self._cond.wait()  # another thread is building it
            if not is_spec:
                self._get_locked(key)  # raises ResourceNotRegisteredError
            entry, dropped = self._reserve_locked(spec_or_key, leases=1)  # type: ignore[arg-type]
        del dropped
        self._build(entry)
        return entry

    def _release(self, entry: _Entry) -> None:
        with self._cond:
            assert entry.leases > 0, f"lease of {entry.key!r} released twice"
            entry.leases -= 1

    def _reserve_locked(self, spec: Spec, leases: int) -> tuple[_Entry, list[_Entry]]:
        """Add a building entry charged its estimate; returns it and the entries evicted."""
        key = spec.key
        if key in self._entries:
            raise DuplicateResourceKeyError(f"key {key!r} is registered already; use a new key, "
                                            "lease the entry, or evict it first")
        estimate = spec.estimated_bytes
        if estimate is None and not hasattr(spec, "nbytes"):
            raise CacheError(f"spec {key!r} gives neither estimated_bytes nor nbytes(value): "
                             "the cache cannot count its bytes")
        if estimate is not None and (not isinstance(estimate, int) or estimate < 0):
            raise CacheError(f"spec {key!r}: estimated_bytes={estimate!r}, expected an "
                             "integer >= 0 or None")
        estimate = estimate or 0
        dropped = self._free_locked(estimate - (self._max - self._used), self._max,
                                    f"admit {key!r} ({estimate} bytes estimated)", estimate)
        entry = _Entry(key, spec, estimate, leases, next(self._clock))
        self._entries[key] = entry
        self._used += estimate
        return entry, dropped

    def _build(self, entry: _Entry) -> None:
        """Build ``entry`` (lock not held), then charge its exact bytes; on any failure the
        entry and its reservation are removed and the error re-raised.
        """
        try:
            value = entry.spec.build()
            nbytes = self._measure(entry.spec, value)
        except BaseException:
            with self._cond:
                self._remove_locked(entry)
                self._cond.notify_all()
            raise
        with self._cond:
            try:
                extra = nbytes - entry.nbytes
                dropped = self._free_locked(extra - (self._max - self._used), self._max,
                                            f"admit {entry.key!r} ({nbytes} bytes built)",
                                            nbytes)
            except BaseException:
                self._remove_locked(entry)
                self._cond.notify_all()
                raise
            self._used += extra
            entry.nbytes, entry.value, entry.state = nbytes, value, "ready"
            self._cond.notify_all()
            logger.debug("admitted %r: %d bytes (%d of %d used)", entry.key, nbytes, self._used,
                         self._max)
        del dropped

    @staticmethod
    def _measure(spec: Spec, value: Any) -> int:
        measure = getattr(spec, "nbytes", None)
        n = measure(value) if measure is not None else spec.estimated_bytes
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise CacheError(f"spec {spec.key!r}: nbytes(value)={n!r}, expected an integer >= 0")
        return n

    def _remove_locked(self, entry: _Entry) -> None:
        assert self._entries.get(entry.key) is entry, f"entry {entry.key!r} is not in the cache"
        del self._entries[entry.key]
        self._used -= entry.nbytes

    def _free_locked(self, need: int, limit: int, why: str,
                     required: int | None = None) -> list[_Entry]:
        """Evict at least ``need`` bytes of unleased entries (nothing if ``need <= 0``).

        Returns the removed entries, so the caller drops their values after the lock.
        """
        if need <= 0:
            return []
        candidates = {k: e.snapshot() for k, e in self._entries.items()
                      if e.state == "ready" and not e.leases}
        evictable = sum(c.nbytes for c in candidates.values())
        if required is not None and required > limit:
            raise ResourceTooLargeError(
                f"cannot {why}: {required} bytes is more than the whole budget ({limit} "
                "bytes); raise max_bytes", required=required, used=self._used, limit=limit)
        if evictable < need:
            pinned = self._used - evictable
            required = pinned if required is None else required
            raise ResourceTooLargeError(
                f"cannot {why}: {need} bytes must be freed but only {evictable} bytes are "
                f"evictable ({pinned} bytes are leased or being built; budget {limit} bytes, "
                f"{self._used} used). End leases, evict entries, or raise max_bytes.",
                required=required, used=self._used, limit=limit)
        context = EvictionContext(MappingProxyType(candidates), need, self._used, limit)
        victims = list(self._policy.choose_victims(context))
        self._check_victims(victims, context)
        dropped = [self._entries[k] for k in victims]
        for e in dropped:
            self._remove_locked(e)
            logger.info("evicted %r (%d bytes, last used at %d) to %s", e.key, e.nbytes,
                        e.last_used, why)
        return dropped

    def _check_victims(self, victims: list[Hashable], context: EvictionContext) -> None:
        name = type(self._policy).__name__
        if len(set(victims)) != len(victims):
            raise EvictionPolicyError(f"{name} chose a key more than once ({victims!r}); "
                                      "nothing was evicted")
        strays = [k for k in victims if k not in context.candidates]
        if strays:
            raise EvictionPolicyError(f"{name} chose keys that are not candidates (leased, "
                                      f"being built, or unknown): {strays!r}; nothing was "
                                      "evicted")
        freed = sum(context.candidates[k].nbytes for k in victims)
        if freed < context.bytes_to_free:
            raise EvictionPolicyError(f"{name} chose {freed} bytes but {context.bytes_to_free} "
                                      "must be freed; nothing was evicted")
