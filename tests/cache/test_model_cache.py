"""ModelCache.use: outputs equal the plain model, reuse, adapters, and unwinding on failures
injected at each step (adapter build, factory, capture, activation, the body).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import shuttle
from shuttle.cache import LoRASpec, ModelCache, ModelSpec, ObjectSpec
from shuttle.errors import (
    AdapterFileError,
    BlockPathError,
    CacheError,
    InvalidOptionError,
    InvalidStrengthError,
    ModelInUseError,
    ResourceTooLargeError,
)
from shuttle.offload import CPU_COPY_ENV, ModelOffloader, StreamConfig
from tests import RecordedBar, lowrank_state
from tests.offload.models import TinyDiT

PATHS = ("blocks", "single")


class Factory:
    """Builds a TinyDiT (seeded) and counts the builds; keeps a reference copy."""

    def __init__(self, fail=False):
        self.calls = 0
        self.fail = fail
        torch.manual_seed(1)
        self.reference = TinyDiT()

    def __call__(self):
        self.calls += 1
        if self.fail:
            raise RuntimeError("injected factory failure")
        return copy.deepcopy(self.reference)


def tokens():
    return torch.randint(0, 64, (2, 9))


def lora_state_dict(rank=4, dim=32):
    return lowrank_state({f"blocks.{i}.{name}": shape for i in range(2)
                          for name, shape in {"attn": (dim, dim), "up": (4 * dim, dim)}.items()},
                         rank=rank, seed=3)


def assert_quiet(cache):
    """Nothing leased, nothing in use, bytes exact."""
    snap = cache.snapshot()
    assert all(e.leases == 0 for e in snap.entries), snap.entries
    assert snap.used_bytes == sum(e.nbytes for e in snap.entries) <= snap.max_bytes
    assert not any(cache.in_use(e.key) for e in snap.entries)


@pytest.mark.parametrize("cpu_copy", [False, True])
@pytest.mark.parametrize("stream", [None, StreamConfig(prefetch=1)])
def test_use_gives_the_plain_models_output(monkeypatch, cpu_copy, stream):
    if cpu_copy:
        monkeypatch.setenv(CPU_COPY_ENV, "1")
    factory = Factory()
    spec = ModelSpec("dit", factory, blocks=PATHS)
    cache = ModelCache(max_bytes=2**20)
    x = tokens()
    want = factory.reference(x)
    for _ in range(2):
        with cache.use(spec, device="cpu", stream=stream) as m:
            assert cache.info("dit").leases == 1 and cache.in_use("dit")
            torch.testing.assert_close(m(x), want, rtol=0, atol=0)
    assert factory.calls == 1  # built once, reused
    with cache.lease("dit") as off:
        assert not off.active
        assert cache.info("dit").nbytes == off.storage.host_bytes > 0
    assert_quiet(cache)


def test_use_by_key_and_adopted_host_bytes():
    factory = Factory()
    cache = ModelCache(max_bytes=2**20)
    cache.register(ModelSpec("dit", factory, blocks="blocks", host="adopt"))
    with cache.use("dit", device="cpu") as m:
        torch.testing.assert_close(m(x := tokens()), factory.reference(x), rtol=0, atol=0)
    with cache.lease("dit") as off:
        assert off.storage.host_bytes == 0
        assert cache.info("dit").nbytes == off.storage.weight_bytes > 0


@pytest.mark.parametrize("host", ["pinned", "adopt"])
def test_building_a_model_shows_its_bytes_as_they_are_captured(monkeypatch, host):
    from shuttle.cache import specs

    monkeypatch.setattr(specs, "tqdm", RecordedBar)
    monkeypatch.setattr(RecordedBar, "bars", [])
    monkeypatch.setattr(specs, "PROGRESS_MIN_BYTES", 0)
    seen = []
    original = ModelOffloader.from_module

    def spy(*args, progress=None, **kw):  # the bar moves unit by unit, not in one step
        return original(*args, progress=lambda n: (seen.append(n), progress(n)), **kw)
    monkeypatch.setattr(ModelOffloader, "from_module", spy)
    cache = ModelCache(max_bytes=2**24)
    cache.register(ModelSpec("dit", Factory(), blocks="blocks", host=host))
    with cache.lease("dit") as off:
        weights = off.storage.weight_bytes
    (bar,) = RecordedBar.bars
    assert bar.desc == "pinning dit" and bar.n == bar.total == weights
    assert len(seen) == (len(off.storage.units) if host == "pinned" else 0)


def test_models_share_the_budget_and_evict_lru(caplog):
    a, b = Factory(), Factory()
    cache = ModelCache(max_bytes=2**20)
    with cache.use(spec_a := ModelSpec("a", a), device="cpu"):
        pass
    size = cache.info("a").nbytes
    cache.resize(size + size // 2)  # room for one model only
    with caplog.at_level(logging.INFO, logger="shuttle.cache"), \
            cache.use(ModelSpec("b", b), device="cpu"):
        pass
    assert cache.keys() == ["b"]
    assert any("evicted 'a'" in r.getMessage() for r in caplog.records)
    with cache.use("b", device="cpu"), pytest.raises(ResourceTooLargeError), \
            cache.use(spec_a, device="cpu"):  # b is leased: a cannot come back
        pass
    assert cache.keys() == ["b"]
    assert_quiet(cache)


def test_streamed_and_resident_blocks_are_logged(monkeypatch, caplog):
    monkeypatch.setenv(CPU_COPY_ENV, "1")
    cache = ModelCache(max_bytes=2**20)
    with caplog.at_level(logging.INFO, logger="shuttle.cache"), \
            cache.use(ModelSpec("dit", Factory(), blocks=PATHS), device="cpu",
                      stream=StreamConfig(prefetch=1, resident=1)):
        pass
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "blocks: 1 of 5 blocks resident" in text and "4 streamed" in text


def test_a_second_use_of_the_same_model_raises_and_the_first_goes_on():
    factory = Factory()
    spec = ModelSpec("dit", factory, blocks=PATHS)
    cache = ModelCache(max_bytes=2**20)
    with cache.use(spec, device="cpu") as m:
        with pytest.raises(ModelInUseError), cache.use(spec, device="cpu"):
            pass
        assert cache.in_use("dit") and cache.info("dit").leases == 1
        torch.testing.assert_close(m(x := tokens()), factory.reference(x), rtol=0, atol=0)
    assert_quiet(cache)


# -- failures injected at each step ----------------------------------------------------------

def test_adapter_build_failure_unwinds():
    factory = Factory()
    cache = ModelCache(max_bytes=2**20)
    cache.register(good := LoRASpec("good", lora_state_dict()))
    bad = LoRASpec("bad", "/nonexistent/adapter.safetensors")
    with pytest.raises(AdapterFileError), \
            cache.use(ModelSpec("dit", factory), device="cpu", loras=[(good, 1.0), (bad, 1.0)]):
        pass
    assert factory.calls == 0 and cache.keys() == ["good"]
    assert_quiet(cache)


@pytest.mark.parametrize("step", ["factory", "capture", "activation", "body"])
def test_failure_at_each_step_leaves_no_lease_and_exact_bytes(monkeypatch, step):
    cache = ModelCache(max_bytes=2**20)
    cache.register(ObjectSpec("other", object, bytes=100))
    loras = [(LoRASpec("style", lora_state_dict()), 1.0)]
    factory = Factory(fail=step == "factory")
    spec = ModelSpec("dit", factory, estimated_bytes=5000,
                     blocks="nowhere" if step == "capture" else PATHS)
    if step == "activation":
        def failing_activate(self, *args, **kwargs):
            raise RuntimeError("injected activation failure")

        monkeypatch.setattr(ModelOffloader, "activate", failing_activate)
    expected = {"factory": RuntimeError, "capture": BlockPathError,
                "activation": RuntimeError, "body": ValueError}[step]
    with pytest.raises(expected), cache.use(spec, device="cpu", loras=loras) as m:
        raise ValueError(f"injected body failure ({m is not None})")
    assert_quiet(cache)
    built = step in ("activation", "body")
    assert ("dit" in cache) == built
    expected_bytes = 100  # the estimate reserved for "dit" was returned or replaced
    if loras:
        with cache.lease("style") as lora:
            expected_bytes += lora.nbytes
    if built:
        with cache.lease("dit") as off:
            assert not off.active
            expected_bytes += off.storage.host_bytes
        del off
    assert cache.used_bytes == expected_bytes
    if built:
        monkeypatch.undo()
        with cache.use(spec, device="cpu") as m:  # usable again after the failure
            torch.testing.assert_close(m(x := tokens()), factory.reference(x), rtol=0, atol=0)
    assert_quiet(cache)


def test_a_value_that_is_not_an_offloader_is_refused_and_released():
    cache = ModelCache(max_bytes=1000)
    with pytest.raises(CacheError, match="not a ModelOffloader"), \
            cache.use(ObjectSpec("o", object, bytes=10), device="cpu"):
        pass
    assert_quiet(cache)


def test_bad_strength_is_refused_before_anything_is_built():
    factory = Factory()
    cache = ModelCache(max_bytes=2**20)
    with pytest.raises(InvalidStrengthError), \
            cache.use(ModelSpec("dit", factory), device="cpu",
                      loras=[(LoRASpec("s", lora_state_dict()), float("nan"))]):
        pass
    assert factory.calls == 0 and len(cache) == 0


def test_an_unknown_mode_raises_before_anything_is_built():
    factory = Factory()
    cache = ModelCache(max_bytes=2**20)
    with pytest.raises(InvalidOptionError, match="mode='sideways'"), \
            cache.use(ModelSpec("dit", factory), device="cpu",
                      loras=[(LoRASpec("s", lora_state_dict()), 1.0)], mode="sideways"):
        pass
    assert factory.calls == 0 and len(cache) == 0


# -- adapters ---------------------------------------------------------------------------------

def test_lora_spec_loads_casts_and_counts_bytes():
    cache = ModelCache(max_bytes=2**20)
    sd = lora_state_dict()
    spec = LoRASpec("s", sd, dtype=torch.bfloat16)
    with cache.lease(spec) as lora:
        tensors = [t for _, p in lora.patches() for _, t in p.tensors()]
        assert all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in tensors)
        assert cache.info("s").nbytes == lora.nbytes == sum(t.numel() for t in sd.values()) * 2


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_use_with_loras_matches_apply_lora(monkeypatch, mode):
    monkeypatch.setenv(CPU_COPY_ENV, "1")
    factory = Factory()
    cache = ModelCache(max_bytes=2**20)
    spec = LoRASpec("style", lora_state_dict())
    x = tokens()
    ref = copy.deepcopy(factory.reference)
    with shuttle.apply_lora(ref, [(shuttle.load_lora(lora_state_dict()), 0.8)], mode=mode):
        want = ref(x)
    with cache.use(ModelSpec("dit", factory, blocks=PATHS), device="cpu",
                   loras=[(spec, 0.8)], mode=mode, stream=StreamConfig(prefetch=1)) as m:
        assert cache.info("style").leases == 1
        torch.testing.assert_close(m(x), want)
    with cache.use("dit", device="cpu") as m:  # adapters gone with the activation
        torch.testing.assert_close(m(x), factory.reference(x), rtol=0, atol=0)
    assert_quiet(cache)


def test_use_passes_quality_and_mapping_to_the_activation(monkeypatch):
    """Keys no rule places, placed by ``mapping``, at the exact tier: the output equals
    apply_lora with the same arguments bit for bit."""
    monkeypatch.setenv(CPU_COPY_ENV, "1")
    factory = Factory()
    cache = ModelCache(max_bytes=2**20)
    sd = {k.replace("blocks.", "layer_"): v for k, v in lora_state_dict().items()}
    mapping = {f"layer_{i}.{n}": f"blocks.{i}.{n}" for i in range(2) for n in ("attn", "up")}
    x = tokens()
    ref = copy.deepcopy(factory.reference)
    with shuttle.apply_lora(ref, [(shuttle.load_lora(sd), 0.8)], mode="dynamic",
                            quality="exact", mapping=mapping, strict=True):
        want = ref(x)
    with cache.use(ModelSpec("dit", factory, blocks=PATHS), device="cpu",
                   loras=[(LoRASpec("odd", sd), 0.8)], mode="dynamic", quality="exact",
                   mapping=mapping, stream=StreamConfig(prefetch=1)) as m:
        assert torch.equal(m(x), want)
    assert not torch.equal(want, factory.reference(x))
    assert_quiet(cache)


def test_zero_strength_adapters_are_not_built():
    cache = ModelCache(max_bytes=2**20)
    bad = LoRASpec("never", "/nonexistent/adapter.safetensors")
    with cache.use(ModelSpec("dit", Factory()), device="cpu", loras=[(bad, 0.0)]):
        pass
    assert cache.keys() == ["dit"]


def test_the_former_lora_mode_keyword_warns_and_works(monkeypatch):
    monkeypatch.setenv(CPU_COPY_ENV, "1")
    factory = Factory()
    cache = ModelCache(max_bytes=2**20)
    spec = LoRASpec("style", lora_state_dict())
    with pytest.warns(FutureWarning, match="lora_mode= is now mode="), \
            cache.use(ModelSpec("dit", factory, blocks=PATHS), device="cpu",
                      loras=[(spec, 0.8)], lora_mode="dynamic") as m:
        off = cache.info("dit")
        assert m is not None and off.leases == 1
    assert_quiet(cache)


def test_a_compressed_spec_charges_its_coded_bytes(monkeypatch):
    from shuttle.kernels import exponent_decode

    monkeypatch.setattr(exponent_decode, "interpreting", lambda: False)  # CPU: the reference
    torch.manual_seed(2)
    ref = TinyDiT(dim=128, n_blocks=2, n_single=1, dtype=torch.bfloat16)
    cache = ModelCache(max_bytes=2**24)
    plain = ModelSpec("plain", lambda: copy.deepcopy(ref), blocks=PATHS)
    coded = ModelSpec("coded", lambda: copy.deepcopy(ref), blocks=PATHS, compress="lossless")
    outs, x = [], tokens()
    for spec in (plain, coded):
        with cache.use(spec, device="cpu") as m:
            outs.append(m(x))
    assert torch.equal(outs[0], outs[1])
    assert cache.info("coded").nbytes < 0.85 * cache.info("plain").nbytes
    with pytest.raises(CacheError, match="compress"):
        ModelSpec("bad", lambda: ref, host="adopt", compress="lossless")
