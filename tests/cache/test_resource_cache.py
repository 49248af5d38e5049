"""ResourceCache: admission, leases, eviction, resize, errors, and a threaded stress test."""

from __future__ import annotations

import gc
import random
import threading
import weakref
from collections import Counter

import pytest
import torch
from torch import nn

from shuttle.cache import ModelCache, ModelSpec, ObjectSpec, ResourceCache
from shuttle.errors import (
    CacheError,
    DuplicateResourceKeyError,
    ModelInUseError,
    ResourceLeasedError,
    ResourceNotRegisteredError,
    ResourceTooLargeError,
)


def obj(key, nbytes):
    return ObjectSpec(key, factory=lambda: {"key": key}, bytes=nbytes)


def check_accounting(cache):
    snap = cache.snapshot()
    assert snap.used_bytes == sum(e.nbytes for e in snap.entries)
    assert 0 <= snap.used_bytes <= snap.max_bytes
    return snap


def test_register_lease_info_and_bytes():
    cache, spec = ResourceCache(100), obj("a", 30)
    entry = cache.register(spec)
    assert (entry.key, entry.nbytes, entry.leases, entry.state) == ("a", 30, 0, "ready")
    assert cache.used_bytes == 30 and cache.available_bytes == 70
    with cache.lease("a") as value, cache.lease(spec) as again:  # by key, by spec
        assert value is again and value == {"key": "a"}
        assert cache.info("a").leases == 2
    info = cache.info("a")
    assert info.leases == 0 and info.uses == 2
    assert "a" in cache and len(cache) == 1


def test_lease_of_a_new_spec_registers_it():
    cache = ResourceCache(100)
    spec = obj("a", 10)
    with cache.lease(spec) as value:
        assert value == {"key": "a"}
        assert cache.info("a").leases == 1
    assert cache.info("a").leases == 0
    with cache.lease(spec) as again:  # the same spec object: the cached value
        assert again is value


def test_admission_evicts_only_unleased_entries():
    cache = ResourceCache(30)
    for k in "abc":
        cache.register(obj(k, 10))
    with cache.lease("a"):
        cache.register(obj("d", 20))  # a is the oldest but leased: b and c go
        assert cache.keys() == ["a", "d"]
    check_accounting(cache)


def test_too_large_reports_required_used_limit_and_changes_nothing():
    cache = ResourceCache(30)
    cache.register(obj("a", 10))
    cache.register(obj("b", 10))
    with pytest.raises(ResourceTooLargeError, match="whole budget") as err:
        cache.register(obj("huge", 31))
    assert (err.value.required, err.value.used, err.value.limit) == (31, 20, 30)
    with cache.lease("a"), cache.lease("b"), pytest.raises(ResourceTooLargeError) as err:
        cache.register(obj("c", 11))
    assert (err.value.required, err.value.used, err.value.limit) == (11, 20, 30)
    assert cache.keys() == ["a", "b"] and cache.used_bytes == 20


def test_evict_and_its_errors():
    cache = ResourceCache(100)
    cache.register(obj("a", 10))
    with cache.lease("a"), pytest.raises(ResourceLeasedError, match="leased"):
        cache.evict("a")
    assert cache.evict("a") == 10
    assert cache.used_bytes == 0
    with pytest.raises(ResourceNotRegisteredError):
        cache.evict("a")
    with pytest.raises(ResourceNotRegisteredError):
        cache.info("a")
    with pytest.raises(ResourceNotRegisteredError), cache.lease("a"):
        pass


def test_duplicate_keys():
    cache = ResourceCache(100)
    spec = obj("a", 10)
    cache.register(spec)
    with pytest.raises(DuplicateResourceKeyError):
        cache.register(spec)
    with pytest.raises(DuplicateResourceKeyError, match="another spec"), \
            cache.lease(obj("a", 10)):  # a new lambda: a different spec under the same key
        pass
    assert cache.info("a").leases == 0


def test_clear_keeps_leased_entries():
    cache = ResourceCache(100)
    for k in "abc":
        cache.register(obj(k, 10))
    with cache.lease("b"):
        assert cache.clear() == 20
        assert cache.keys() == ["b"]
    assert cache.clear() == 10 and len(cache) == 0 and cache.used_bytes == 0


def test_resize():
    cache = ResourceCache(40)
    for k in "abcd":
        cache.register(obj(k, 10))
    with cache.lease("a"):
        cache.resize(25)  # LRU: b and c go (a is leased)
        assert cache.keys() == ["a", "d"] and cache.max_bytes == 25
        with cache.lease("d"), pytest.raises(ResourceTooLargeError) as err:
            cache.resize(15)
        assert (err.value.required, err.value.used, err.value.limit) == (20, 20, 15)
        assert cache.max_bytes == 25 and cache.keys() == ["a", "d"]
    cache.resize(100)
    assert cache.available_bytes == 80
    with pytest.raises(CacheError):
        cache.resize(-1)
    with pytest.raises(CacheError, match="number of bytes"):
        ResourceCache(float("nan"))
    assert ResourceCache("1KiB").max_bytes == 1024  # budgets as users spell them


class Custom:
    """A spec that inherits nothing: key, estimated_bytes, build() and nbytes(value)."""

    def __init__(self, key, estimate, actual, fail=False):
        self.key, self.estimated_bytes, self.actual, self.fail = key, estimate, actual, fail
        self.builds = 0

    def build(self):
        self.builds += 1
        if self.fail:
            raise RuntimeError("build failed")
        return bytearray(self.actual)

    def nbytes(self, value):
        return len(value)


def test_custom_spec_charged_its_exact_bytes_not_the_estimate():
    cache = ResourceCache(100)
    cache.register(obj("old", 50))
    spec = Custom("c", estimate=10, actual=60)  # the estimate is low: old goes after building
    cache.register(spec)
    assert cache.keys() == ["c"] and cache.used_bytes == 60
    assert cache.info("c").nbytes == 60


def test_build_failure_and_oversized_build_return_the_reservation():
    cache = ResourceCache(100)
    cache.register(obj("a", 10))
    with pytest.raises(RuntimeError, match="build failed"):
        cache.register(Custom("bad", 20, 20, fail=True))
    with pytest.raises(ResourceTooLargeError):
        cache.register(Custom("big", 10, 200))
    assert cache.keys() == ["a"] and cache.used_bytes == 10
    check_accounting(cache)


def test_spec_without_any_byte_count_is_refused():
    class NoBytes:
        key, estimated_bytes = "x", None

        def build(self):
            return object()

    with pytest.raises(CacheError, match="cannot count"):
        ResourceCache(10).register(NoBytes())


def test_a_second_lease_waits_for_the_build_in_progress():
    started, release = threading.Event(), threading.Event()

    class Slow(Custom):
        def build(self):
            started.set()
            assert release.wait(5)
            return super().build()

    cache, spec, got = ResourceCache(100), Slow("s", 8, 8), []

    def lease():
        with cache.lease(spec) as value:
            got.append(value)

    first = threading.Thread(target=lease)
    first.start()
    assert started.wait(5)
    assert cache.info("s").state == "building" and cache.used_bytes == 8
    with pytest.raises(ResourceLeasedError, match="being built"):
        cache.evict("s")
    second = threading.Thread(target=lease)
    second.start()
    release.set()
    first.join(5)
    second.join(5)
    assert spec.builds == 1 and len(got) == 2 and got[0] is got[1]
    assert cache.info("s").leases == 0


# -- the stress test --------------------------------------------------------------------------

class Tracker:
    """Counts built objects and how many of them were released (finalized)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.built = 0
        self.released = 0

    def track(self, value):
        with self.lock:
            self.built += 1
        weakref.finalize(value, self._released)
        return value

    def _released(self):
        with self.lock:
            self.released += 1


class Payload:
    def __init__(self, key):
        self.key = key


def tiny_model():
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))


def test_threaded_random_steps_keep_exact_accounting_and_release_everything():
    tracker = Tracker()
    flaky_rng = random.Random(1)

    def make(key):
        return lambda: tracker.track(Payload(key))

    def flaky():
        if flaky_rng.random() < 0.5:
            raise RuntimeError("injected build failure")
        return tracker.track(Payload("flaky"))

    specs = {f"o{i}": ObjectSpec(f"o{i}", make(f"o{i}"), bytes=1 + i % 7) for i in range(12)}
    specs["flaky"] = ObjectSpec("flaky", flaky, bytes=3)
    # Fits only when at most 20 other bytes are held: refused while a model is leased.
    specs["big"] = ObjectSpec("big", make("big"), bytes=580)
    # Tiny models hold 3 * (16 + 4) floats: 240 bytes of weights, adopted (pinned arenas
    # would be whole pages where CUDA is present: larger than the whole budget).
    models = {f"m{i}": ModelSpec(f"m{i}", lambda: tracker.track(tiny_model()), blocks="1",
                                 host="adopt")
              for i in range(2)}
    cache = ModelCache(max_bytes=600)
    errors, steps, done = [], 250, Counter()  # 250 x 4 threads = 1000 steps
    expected = (ResourceTooLargeError, ResourceLeasedError, ResourceNotRegisteredError,
                DuplicateResourceKeyError, ModelInUseError)

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(steps):
                op = rng.choice(["register", "lease", "lease2", "lease_evict", "evict", "use",
                                 "clear"])
                key = rng.choice(list(specs))
                try:
                    if op == "register":
                        cache.register(specs[key])
                    elif op == "lease":
                        with cache.lease(specs[key]) as v:
                            assert v.key == key
                            check_accounting(cache)
                    elif op == "lease2":
                        other = rng.choice(list(specs))
                        with cache.lease(specs[key]) as a, cache.lease(specs[other]) as b:
                            assert (a.key, b.key) == (key, other)
                            assert cache.info(key).leases >= 1
                    elif op == "lease_evict":  # a leased entry cannot be evicted
                        with cache.lease(specs[key]):
                            cache.evict(key)
                    elif op == "evict":
                        cache.evict(key)
                    elif op == "use":
                        with cache.use(models[rng.choice(list(models))], device="cpu") as m:
                            m(torch_ones())
                            if rng.random() < 0.5:  # 240 bytes leased: "big" cannot fit
                                with cache.lease(specs["big"]):
                                    raise AssertionError("big admitted beside a leased model")
                    elif rng.random() < 0.1:
                        cache.clear()
                    done[op] += 1
                except expected as e:
                    done[type(e).__name__] += 1
                except RuntimeError as e:
                    if "injected" not in str(e):
                        raise
                    done["injected"] += 1
                check_accounting(cache)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sum(done.values()) == 1000
    for outcome in ("register", "lease", "lease2", "evict", "use", "ResourceLeasedError",
                    "ResourceTooLargeError", "injected"):
        assert done[outcome] > 0, (outcome, done)
    snap = check_accounting(cache)
    assert all(e.leases == 0 and e.state == "ready" for e in snap.entries)
    assert not any(cache.in_use(k) for k in models)
    for e in snap.entries:
        if e.key in models:
            with cache.lease(e.key) as off:
                assert e.nbytes == off.storage.weight_bytes == 240
            del off  # the test's own reference
    assert tracker.built > 20
    cache.clear()
    assert cache.used_bytes == 0 and len(cache) == 0
    gc.collect()
    assert tracker.released == tracker.built


def torch_ones():
    return torch.ones(2, 4)
