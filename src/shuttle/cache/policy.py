"""Which unleased entries to evict: the :class:`EvictionPolicy` protocol and LRU.

A policy only chooses. The cache builds the candidates (entries that are built and not leased)
and the number of bytes to free, calls :meth:`EvictionPolicy.choose_victims` under its lock,
then checks the answer (unique keys, candidates only, enough bytes) before evicting anything.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

__all__ = ["CacheEntry", "EvictionContext", "EvictionPolicy", "LRUEvictionPolicy"]


@dataclass(frozen=True)
class CacheEntry:
    """A snapshot of one cache entry, as ``ResourceCache.info`` returns it.

    Attributes:
        key: the entry's key.
        nbytes: bytes charged to the budget. While ``state == "building"`` this is the spec's
            estimate (the reservation); once built, the exact bytes the value holds.
        leases: leases held now; a leased entry is never evicted.
        state: ``"building"`` (the spec's ``build()`` is running) or ``"ready"``.
        last_used: a counter, larger for more recent admissions and leases.
        uses: how many leases were taken since admission.
    """

    key: Hashable
    nbytes: int
    leases: int
    state: Literal["building", "ready"]
    last_used: int
    uses: int


@dataclass(frozen=True)
class EvictionContext:
    """What a policy chooses from.

    Attributes:
        candidates: key -> entry, for every built, unleased entry (the only evictable ones).
        bytes_to_free: evict at least this many bytes (> 0).
        used_bytes: bytes charged now.
        max_bytes: the cache's budget.
    """

    candidates: Mapping[Hashable, CacheEntry]
    bytes_to_free: int
    used_bytes: int
    max_bytes: int


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses which candidates to evict. Called under the cache lock: keep it quick."""

    def choose_victims(self, context: EvictionContext) -> Iterable[Hashable]:
        """Return keys of ``context.candidates``, each once, together holding at least
        ``context.bytes_to_free`` bytes. The cache evicts exactly these, or nothing (raising
        :class:`~shuttle.errors.EvictionPolicyError`) if the answer breaks these rules.
        """
        ...


class LRUEvictionPolicy:
    """Evict the least recently used candidates first, until enough bytes are freed."""

    def choose_victims(self, context: EvictionContext) -> list[Hashable]:
        victims, freed = [], 0
        for entry in sorted(context.candidates.values(), key=lambda e: e.last_used):
            if freed >= context.bytes_to_free:
                break
            victims.append(entry.key)
            freed += entry.nbytes
        return victims

    def __repr__(self) -> str:
        return "LRUEvictionPolicy()"
