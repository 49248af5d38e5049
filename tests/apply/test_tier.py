"""The tier chooser (quality="auto", the default): the fastest implementation per layer shape,
measured once per key, lossless wherever nothing can be measured.

Timings never enter these tests: the chooser is given a fake measure that ranks the candidates
as the test says, and the forward's output tells which implementation ran (the fused and the
lossless tiers round differently).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import shuttle
import shuttle.apply.dynamic_layer as dynamic_layer
from shuttle.apply import tier
from shuttle.apply.tier import MODES, TierChooser, TierKey, round_orders, row_bucket
from shuttle.kernels import triton_available


def _key(rows=128):
    return TierKey("cuda:0", torch.bfloat16, rows, 64, 32, 8, True)


def _ranked(order, calls=None):
    """A measure ranking candidates by their place in ``order`` (first: fastest), the same
    eagerly and in graphs unless ``order`` is a dict {graphs: order}; every candidate costs
    the host the same."""
    def measure(fn, mode):
        name = fn.name
        if calls is not None:
            calls.append((name, mode))
        if mode == "host":
            return 0.0
        ranks = order[mode == "graphs"] if isinstance(order, dict) else order
        return float(ranks.index(name))
    return measure


def _named(**fns):
    out = {}
    for name, fn in fns.items():
        fn.name = name
        out[name] = fn
    return out


def _noop():
    def fn():
        return None
    return fn


def test_the_fastest_candidate_wins_per_mode_and_is_measured_once():
    calls = []
    chooser = TierChooser(_ranked({False: ["fused", "lossless"], True: ["lossless", "fused"]},
                                  calls))
    cands = _named(lossless=_noop(), fused=_noop())
    assert chooser.choose(_key(), cands) == "fused"
    assert chooser.choose(_key(), cands, graphs=True) == "lossless"
    # side by side in time: every candidate in one mode before any in the next, in rounds of
    # alternating order, at least _VISITS of them
    assert calls == [(name, mode) for mode in MODES
                     for _ in range(tier._VISITS // 2)
                     for name in ("lossless", "fused", "fused", "lossless")]
    assert chooser.known(_key(), graphs=False) == "fused"
    assert chooser.known(_key(256), graphs=False) is None  # another row bucket
    chooser.clear()
    assert chooser.known(_key(), graphs=False) is None


def test_a_steady_drift_of_the_clocks_favours_no_candidate():
    # every call 10% faster than the one before (clocks ramping up): equal candidates measured
    # in one order would make the last look fastest
    calls = []
    chooser = TierChooser(lambda fn, mode: calls.append(fn.name) or 1.0 - 0.1 * len(calls))
    cands = _named(lossless=_noop(), fused=_noop(), fused_cute=_noop())
    assert chooser.choose(_key(), cands) == "lossless"
    assert chooser.choose(_key(), cands, graphs=True) == "lossless"
    for mode in MODES:
        times = getattr(chooser.choices[_key()], mode)
        assert max(times.values()) - min(times.values()) < 1e-9, mode


def test_lossless_wins_ties_and_near_ties_and_a_failing_candidate_is_dropped():
    from shuttle.apply.tier import GRAPHS_MARGIN, MARGIN

    chooser = TierChooser(lambda fn, mode: 1.0)
    assert chooser.choose(_key(), _named(fused=_noop(), lossless=_noop())) == "lossless"
    assert chooser.known(_key(), graphs=True) == "lossless"
    # eagerly within MARGIN, in graphs within the narrower GRAPHS_MARGIN
    for fused, eager, graphs in ((1 - GRAPHS_MARGIN / 2, "lossless", "lossless"),
                                 (1 - 2 * GRAPHS_MARGIN, "lossless", "fused"),
                                 (1 - 2 * MARGIN, "fused", "fused")):
        chooser = TierChooser(lambda fn, mode, f=fused: f if fn.name == "fused" else 1.0)
        assert chooser.choose(_key(), _named(fused=_noop(), lossless=_noop())) == eager
        assert chooser.known(_key(), graphs=True) == graphs

    def broken():
        raise RuntimeError("cannot launch")
    chooser = TierChooser(lambda fn, mode: fn() or 0.0)
    assert chooser.choose(_key(), {"fused_cute": broken, "lossless": _noop()}) == "lossless"
    assert set(chooser.choices[_key()].host) == {"lossless"}  # dropped in every mode
    # failing in a later mode only: dropped from the modes measured before it too
    chooser = TierChooser(lambda fn, mode: (fn() or 0.5) if mode == "graphs" else 0.5)
    assert chooser.choose(_key(), {"fused": broken, "lossless": _noop()}) == "lossless"
    assert all(set(ts) == {"lossless"} for ts in (chooser.choices[_key()].eager,
                                                   chooser.choices[_key()].graphs))
    with pytest.raises(RuntimeError, match="cannot launch"):
        TierChooser(lambda fn, mode: fn() or 0.0).choose(_key(), {"lossless": broken})


def test_lossless_runs_before_anything_is_timed():
    """The device is warmed by lossless's call first (an idle device boosts its first
    milliseconds, which would favour whatever is measured first), once per key."""
    events = []
    chooser = TierChooser(lambda fn, mode: events.append((fn.name, mode)) or 1.0,
                          warm=lambda fn: events.append((fn.name, "warm")))
    cands = _named(fused=_noop(), lossless=_noop())
    chooser.choose(_key(), cands)
    chooser.choose(_key(), cands)
    assert events[0] == ("lossless", "warm") and events.count(("lossless", "warm")) == 1
    assert len(events) == 1 + 2 * tier._VISITS * len(MODES)


@pytest.mark.parametrize("n", range(1, 9))
def test_round_orders_balance_places_and_predecessors(n):
    """Every candidate in every place equally often (a steady drift adds the same to each
    mean) and after every other equally often within the rounds (each one's after-effect on
    the clocks falls on all alike), never right after itself from three candidates on."""
    orders = round_orders(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    for place in range(n):
        assert sorted(order[place] for order in orders) == sorted(
            list(range(n)) * (len(orders) // n))
    follows = collections.Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(follows.values())) <= 1
    sequence = [i for order in orders for i in order]
    assert n <= 2 or all(a != b for a, b in zip(sequence, sequence[1:], strict=False))


def test_a_candidate_slowing_the_next_slows_every_other_alike():
    """A candidate after which the device runs slower (its power draw holds the clocks down)
    must not make one other candidate, measured after it each time, look slow: each of the
    others follows it within a round equally often (a round's first visit follows the last
    round's end: at most one visit more)."""
    names = ["lossless", "fused", "fused_cute", "fused_cute_pingpong", "fused_cute_shrink"]
    previous = []

    def measure(fn, mode):
        slowed = bool(previous) and previous[-1] == "fused_cute_pingpong"
        previous.append(fn.name)
        return {"lossless": 1.0}.get(fn.name, 0.9) * (1.5 if slowed else 1.0)

    chooser = TierChooser(measure)
    assert chooser.choose(_key(), _named(**{name: _noop() for name in names})) != "lossless"
    visits = len(previous) // len(MODES) // len(names)
    for mode in MODES:
        times = getattr(chooser.choices[_key()], mode)
        others = [times[name] for name in names[1:] if name != "fused_cute_pingpong"]
        assert max(others) - min(others) <= 0.9 * 0.5 / visits + 1e-9, mode
        assert times["lossless"] > max(others), mode


def _timed(**changed):
    """(microseconds per mode and candidate, a chooser measuring them, the candidates): each
    mode lossless 100, fused 90, cute 70 (host time 60 each), with ``changed``'s entries
    (mode -> {candidate: us}) in place."""
    us = {mode: {"lossless": 100, "fused": 90, "fused_cute": 70} for mode in MODES}
    us["host"] = {"lossless": 60, "fused": 60, "fused_cute": 60}
    for mode, entries in changed.items():
        us[mode].update(entries)
    chooser = TierChooser(lambda fn, mode: us[mode][fn.name] * 1e-6)
    return us, chooser, _named(lossless=_noop(), fused=_noop(), fused_cute=_noop())


@pytest.mark.parametrize(("host_us", "eager_pick"), [
    (60.0, "fused_cute"),   # no more host time than lossless's: the faster burst wins
    (62.5, "fused_cute"),   # within MARGIN (3%) of lossless's 100 us call
    (63.5, "fused"),        # beyond it: the next fastest that the host can afford
])
def test_eagerly_a_candidate_costing_the_host_more_than_lossless_is_not_picked(host_us,
                                                                              eager_pick):
    """A burst of one layer hides a slow launcher under the layer's own GPU time; in a
    forward bound by the host it would not be hidden: eagerly, only candidates whose host
    time is within MARGIN of lossless's call compete. In graphs the host does not count."""
    us, chooser, cands = _timed(host={"fused": 40, "fused_cute": host_us})
    assert chooser.choose(_key(), cands) == eager_pick
    assert chooser.known(_key(), graphs=True) == "fused_cute"
    # nothing else under the host's bar: lossless
    us["host"]["fused"] = 100
    chooser.clear()
    assert chooser.choose(_key(), cands) == ("fused_cute" if host_us <= 62.5 else "lossless")


@pytest.mark.parametrize(("idle_us", "eager_pick"), [
    (100.0, "fused_cute"),  # as fast as lossless from an idle device: the faster burst wins
    (101.0, "fused"),       # slower: the next fastest that is not
])
def test_eagerly_a_candidate_slower_than_lossless_from_an_idle_device_is_not_picked(idle_us,
                                                                                    eager_pick):
    """A layer called on its own (or after a sync) waits for its launches in order: a tier
    faster in a burst but slower from an idle device would make such a call slower than
    lossless. In graphs the idle latency does not count."""
    us, chooser, cands = _timed(idle={"fused": 95, "fused_cute": idle_us})
    assert chooser.choose(_key(), cands) == eager_pick
    assert chooser.known(_key(), graphs=True) == "fused_cute"
    us["idle"]["fused"] = 120
    chooser.clear()
    assert chooser.choose(_key(), cands) == ("fused_cute" if idle_us <= 100 else "lossless")


@pytest.mark.parametrize(("rows", "bucket"), [(1, 1), (2, 2), (3, 4), (64, 64), (65, 128),
                                              (32760, 32768)])
def test_rows_share_a_measurement_within_a_power_of_two(rows, bucket):
    assert row_bucket(rows) == bucket


def test_the_default_is_auto_and_off_cuda_it_runs_lossless_without_measuring(monkeypatch):
    calls = []
    monkeypatch.setattr(dynamic_layer, "TIERS", TierChooser(_ranked(["fused", "lossless"],
                                                                    calls)))
    m, sd, x = _model()
    with torch.no_grad():  # (autograd recording alone would also keep it lossless)
        with shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic") as h:
            assert h.quality == "auto"
            got = m(x)
        with shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic", quality="lossless"):
            want = m(x)
    assert torch.equal(got, want) and not calls


def _model():
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    m = nn.Sequential(nn.Linear(32, 64), nn.Linear(32, 64)).bfloat16()
    m.forward = lambda x: m[0](x) + m[1](x)  # two layers of one shape
    sd = {}
    for i in (0, 1):
        sd[f"{i}.lora_A.weight"] = (torch.randn(8, 32, generator=g) * 0.3).bfloat16()
        sd[f"{i}.lora_B.weight"] = (torch.randn(64, 8, generator=g) * 0.3).bfloat16()
    x = torch.randn(100, 32, generator=g).bfloat16()
    return m, sd, x


@pytest.mark.skipif(not triton_available(), reason="the fused tier needs triton")
@pytest.mark.parametrize("fastest", ["fused", "lossless"])
def test_auto_runs_the_measured_fastest_and_layers_of_one_shape_share_it(monkeypatch, fastest):
    calls = []
    order = [fastest, "lossless" if fastest == "fused" else "fused"]

    def measure(fn, mode):
        calls.append(mode)
        return 0.0 if mode == "host" else float(order.index(names[fn]))
    names: dict = {}

    chooser = TierChooser(measure, devices=("cuda", "cpu"))
    real_choose = chooser.choose

    def choose(key, candidates, *, graphs=False):
        names.update({fn: name for name, fn in candidates.items()})
        return real_choose(key, candidates, graphs=graphs)
    chooser.choose = choose
    monkeypatch.setattr(dynamic_layer, "TIERS", chooser)
    m, sd, x = _model()
    with torch.no_grad():
        with shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic", quality="auto"):
            got = m(x)
        with shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic", quality=fastest):
            want = m(x)
        with shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic",
                                quality="lossless" if fastest == "fused" else "fused"):
            other = m(x)
    assert torch.equal(got, want) and not torch.equal(got, other)
    # one key for both layers: two candidates, each measured in every mode, once
    assert len(chooser.choices) == 1 and len(calls) == 2 * tier._VISITS * len(MODES)


@pytest.mark.skipif(not triton_available(), reason="the fused tier needs triton")
@pytest.mark.parametrize(("rank", "shrink"), [(8, True), (136, False)])
def test_where_cute_runs_its_one_kernel_form_competes_up_to_128_ranks(monkeypatch, rank,
                                                                      shrink):
    """The candidates where the CuTe kernel can take the call: its two-kernel form always, its
    one-kernel form (the shrink among its work units) only for ranks it takes."""
    seen = []

    def choose(key, candidates, *, graphs=False):
        seen.append(set(candidates))
        return "lossless"
    chooser = TierChooser(_ranked(["lossless"]), devices=("cuda", "cpu"))
    chooser.choose = choose
    monkeypatch.setattr(dynamic_layer, "TIERS", chooser)
    monkeypatch.setattr(dynamic_layer.LoRAHook, "_cute_ok", lambda self, module, x: True)
    g = torch.Generator().manual_seed(1)
    m = nn.Sequential(nn.Linear(32, 64)).bfloat16()
    sd = {"0.lora_A.weight": torch.randn(rank, 32, generator=g).bfloat16(),
          "0.lora_B.weight": torch.randn(64, rank, generator=g).bfloat16()}
    with torch.no_grad(), shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic"):
        m(torch.randn(100, 32, generator=g).bfloat16())
    assert seen == [{"lossless", "fused", "fused_cute", "fused_cute_pingpong"}
                    | ({"fused_cute_shrink"} if shrink else set())]


@pytest.mark.skipif(not triton_available(), reason="the fused tier needs triton")
def test_a_layer_keeps_its_pick_until_the_chooser_forgets(monkeypatch):
    calls = []
    chooser = TierChooser(lambda fn, mode: calls.append(mode) or 1.0, devices=("cuda", "cpu"))
    monkeypatch.setattr(dynamic_layer, "TIERS", chooser)
    m, sd, x = _model()
    with torch.no_grad(), shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic"):
        m(x)
        known = chooser.known  # later calls of a measured shape ask the layer's own pick
        chooser.known = lambda *a, **k: pytest.fail("asked the chooser again")
        m(x)
        m(x[:90])  # 90 rows: the same power-of-two bucket as 100
        chooser.known = known
        assert len(calls) == 2 * tier._VISITS * len(MODES)  # two candidates, every round
        chooser.clear()
        m(x[:90])  # the last call's shape: the layer's memo of that call is forgotten too
        assert len(calls) == 2 * 2 * tier._VISITS * len(MODES)  # measured again


@pytest.mark.skipif(not triton_available(), reason="the fused tier needs triton")
def test_auto_runs_lossless_where_autograd_records(monkeypatch):
    monkeypatch.setattr(dynamic_layer, "TIERS", TierChooser(_ranked(["fused", "lossless"]),
                                                            devices=("cuda", "cpu")))
    m, sd, x = _model()
    x.requires_grad_(True)
    with shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic"):
        got = m(x)
    with shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic", quality="lossless"):
        want = m(x)
    assert torch.equal(got, want) and got.requires_grad
    assert not dynamic_layer.TIERS.choices


@pytest.mark.skipif(not triton_available(), reason="the fused tier needs triton")
def test_a_kept_fused_pick_gives_way_to_lossless_where_autograd_records(monkeypatch):
    """The last call's pick is reused without the other checks only when it is lossless: a
    fused pick kept for the shape still yields to autograd on the next call of that shape."""
    chooser = TierChooser(devices=("cuda", "cpu"))
    chooser.choose = lambda key, candidates, *, graphs=False: "fused"  # measures nothing
    monkeypatch.setattr(dynamic_layer, "TIERS", chooser)
    m, sd, x = _model()
    with shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic"):
        with torch.no_grad():
            fused = m(x)
        got = m(x.clone().requires_grad_(True))
    with torch.no_grad(), shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic", quality="fused"):
        want_fused = m(x)
    with shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic", quality="lossless"):
        want = m(x)
    assert torch.equal(fused, want_fused) and not torch.equal(fused, want)
    assert torch.equal(got, want) and got.requires_grad


@pytest.mark.gpu
@pytest.mark.skipif(not triton_available(), reason="the fused tier needs triton")
def test_gpu_auto_measures_and_captures_in_a_graph():
    """On CUDA: the real measure picks a tier per mode; a capture replays that choice."""
    from shuttle.apply.tier import TIERS

    TIERS.clear()
    m, sd, x = _model()
    m, x = m.cuda(), x.cuda()
    with torch.no_grad(), shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic"):
        eager = m(x)
        (key, choice), = TIERS.choices.items()
        assert set(choice.eager) >= {"lossless", "fused"} and key.rows == 128
        assert set(choice.host) == set(choice.eager) and all(t > 0 for t in choice.host.values())
        graph = torch.cuda.CUDAGraph()
        static_x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m(static_x)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = m(static_x)
        graph.replay()
        torch.cuda.synchronize()
    # The graph's pick, forced eagerly in a scope of its own (the first one closed: nested
    # scopes would add the adapter twice).
    best = choice.best(True)
    with torch.no_grad(), shuttle.apply_lora(
            m, [(sd, 0.8)], mode="dynamic",
            quality="lossless" if best == "lossless" else "fused") as h:
        for hook in h.hooks.values():
            hook.allow_cute = best.startswith("fused_cute")
            hook.cute_form = best if hook.allow_cute else hook.cute_form
        want = m(x)
    assert torch.equal(out, want)
    assert eager.shape == out.shape


@pytest.mark.parametrize("mode", ["eager", "host", "idle"])
def test_off_cuda_a_call_is_timed_by_the_clock_and_never_in_graphs(mode):
    from shuttle.apply import tier

    calls = []
    seconds = tier.measure_call(lambda: calls.append(1), mode)
    assert 0 < seconds < 1
    per_sample = 1 if mode == "idle" else tier._BURST  # idle: single calls, twice as many
    assert len(calls) == tier._WARMUP + tier._REPEATS * (2 if mode == "idle" else 1) * per_sample
    if not torch.cuda.is_available():
        assert tier.measure_call(lambda: None, "graphs") == float("inf")
    with pytest.raises(ValueError, match="mode must be one of"):
        tier.measure_call(lambda: None, "graph")


@pytest.mark.gpu
def test_gpu_measurements_hold_no_device_memory_per_key():
    """Measuring many keys keeps the device memory of one capture stream, not one per key
    (cuBLAS keeps a workspace for every stream a matmul ran on, for the process's life).
    """
    from shuttle.apply import tier

    a = torch.randn(256, 256, device="cuda")
    chooser = tier.TierChooser()
    chooser.choose(_key(rows=1), {"lossless": lambda: a @ a})  # the one stream's workspace
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for rows in range(2, 10):
        chooser.choose(_key(rows=rows), {"lossless": lambda: a @ a, "fused": lambda: a @ a.T})
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 8 * 2**20


def test_auto_hands_its_capture_answer_to_the_scale_vector(monkeypatch):
    # The auto tier asks whether a CUDA graph is being captured once per call, for its pick,
    # and the scale vector takes that answer instead of asking again (host time per layer).
    from shuttle.apply.scale_vector import ScaleVector

    told = []
    call = ScaleVector.__call__

    def spy(self, device, capturing=None):
        told.append(capturing)
        return call(self, device, capturing)

    monkeypatch.setattr(ScaleVector, "__call__", spy)
    m, sd, x = _model()
    with torch.no_grad(), shuttle.apply_lora(m, [(sd, 0.8)], mode="dynamic"):
        m(x)
        m(x)
    assert told == [False] * 4  # two layers, two calls: each told, none left to ask
