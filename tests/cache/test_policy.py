"""Eviction policies: LRU order, and the cache's checks of any policy's answer."""

from __future__ import annotations

import pytest

from shuttle.cache import (
    CacheEntry,
    EvictionContext,
    EvictionPolicy,
    LRUEvictionPolicy,
    ObjectSpec,
    ResourceCache,
)
from shuttle.errors import EvictionPolicyError, ResourceTooLargeError


def obj(key, nbytes):
    return ObjectSpec(key, factory=lambda: [key], bytes=nbytes)


def context(sizes_and_stamps, need):
    cands = {k: CacheEntry(k, n, 0, "ready", t, 1) for k, (n, t) in sizes_and_stamps.items()}
    return EvictionContext(cands, need, sum(n for n, _ in sizes_and_stamps.values()), 100)


def test_lru_chooses_oldest_first_until_enough_bytes():
    ctx = context({"a": (10, 3), "b": (10, 1), "c": (10, 2), "d": (10, 4)}, need=15)
    assert LRUEvictionPolicy().choose_victims(ctx) == ["b", "c"]
    assert isinstance(LRUEvictionPolicy(), EvictionPolicy)


def test_lru_in_a_cache_follows_leases_and_registrations():
    cache = ResourceCache(30)
    for k in "abc":
        cache.register(obj(k, 10))
    with cache.lease("a"):  # a becomes the most recent
        pass
    cache.register(obj("d", 10))  # evicts b, the least recently used
    assert cache.keys() == ["a", "c", "d"]
    cache.register(obj("e", 20))  # then c and a
    assert cache.keys() == ["d", "e"]


class Scripted:
    """A policy answering with a fixed list, to test the cache's checks."""

    def __init__(self, answer):
        self.answer = answer
        self.contexts = []

    def choose_victims(self, context):
        self.contexts.append(context)
        return self.answer


def full_cache(policy):
    cache = ResourceCache(30, policy=policy)
    for k in "abc":
        cache.register(obj(k, 10))
    return cache


@pytest.mark.parametrize(("answer", "says"), [
    (["a", "a"], "more than once"),
    (["a", "zzz"], "not candidates"),
    (["b"], "not candidates"),  # b is leased below
    ([], "must be freed"),
    (["a"], "must be freed"),  # 10 bytes chosen, 15 needed
])
def test_invalid_answers_raise_and_evict_nothing(answer, says):
    policy = Scripted(answer)
    cache = full_cache(policy)
    before = cache.snapshot()
    with cache.lease("b"), pytest.raises(EvictionPolicyError, match=says):
        cache.register(obj("new", 15))
    after = cache.snapshot()
    assert [e.key for e in after.entries] == [e.key for e in before.entries]
    assert after.used_bytes == before.used_bytes == 30
    assert "new" not in cache
    ctx = policy.contexts[-1]
    assert ctx.bytes_to_free == 15 and set(ctx.candidates) == {"a", "c"}


def test_a_valid_answer_may_evict_more_than_needed():
    cache = full_cache(Scripted(["c", "a"]))
    cache.register(obj("new", 5))
    assert cache.keys() == ["b", "new"]
    assert cache.used_bytes == 15


def test_policy_is_not_asked_when_it_cannot_succeed():
    policy = Scripted(["a"])
    cache = full_cache(policy)
    with cache.lease("a"), cache.lease("b"), pytest.raises(ResourceTooLargeError) as err:
        cache.register(obj("new", 25))
    assert policy.contexts == []
    assert (err.value.required, err.value.used, err.value.limit) == (25, 30, 30)


def test_policy_is_not_asked_when_nothing_must_go():
    policy = Scripted(["a"])
    cache = ResourceCache(100, policy=policy)
    cache.register(obj("a", 10))
    cache.register(obj("b", 10))
    assert policy.contexts == []
