"""The twin replays the engine's policy (same iterations, loads and evictions for the same requests);
workloads stay in the context and follow their rates; placement and the forest behave."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from unbroken.serve.adapters import write_adapter
from unbroken.serve.config import ServeConfig, serve_model
from unbroken.serve.engine import Engine, Request
from unbroken.serve.perfmodel import PerfModel, twin_dataset
from unbroken.serve.placement import greedy, random_placement, round_robin, servers_used
from unbroken.serve.twin import Costs, simulate
from unbroken.serve.workload import GEN_MAX, PROMPT_MAX, AdapterSet, Arrival, from_trace, generate

torch.set_num_threads(1)
COSTS = Costs(base=0.01, row=0.001, token=1e-4, lora=1e-6, load=0.002, http=0.004)


@pytest.fixture(scope="module")
def adapter_set(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    s = AdapterSet.zipf(6, 1.0, seed=3)
    for name, r in zip(s.names, s.ranks):
        write_adapter(d, name, model=serve_model(), rank=r, seed=r)
    return d, s


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 1000), slots=st.integers(1, 3), batch=st.integers(1, 4))
def test_twin_policy_matches_the_engine(adapter_set, seed, slots, batch):
    d, s = adapter_set
    rng = np.random.default_rng(seed)
    arrivals = [Arrival(0.0, s.names[int(rng.integers(len(s.names)))], int(rng.integers(1, 6)), int(rng.integers(1, 5)))
                for _ in range(10)]
    cfg = ServeConfig(max_batch=batch, slots=slots)
    engine = Engine(cfg, d)
    for a in arrivals:
        engine.submit(Request(a.adapter, [1] * a.prompt_len, a.gen_len))
    engine.run_until_idle()
    _, stats = simulate(cfg, s, arrivals, COSTS, slo_s=1.0)
    assert (stats["iterations"], stats["adapter_loads"], stats["evictions"]) == \
        (engine.iterations, engine.cache.loads, engine.cache.evictions)


def test_twin_latency_grows_past_capacity():
    s = AdapterSet.zipf(12, 1.0, seed=0)
    cfg = ServeConfig(max_batch=4, slots=2)
    light, _ = simulate(cfg, s, generate(s, rate=2, duration_s=20, seed=1), COSTS, slo_s=1.0)
    heavy, _ = simulate(cfg, s, generate(s, rate=80, duration_s=20, seed=1), COSTS, slo_s=1.0)
    assert light.starved == 0 and light.slo == 1.0 and light.p50_s < 0.5
    assert heavy.p95_s > 5 * light.p95_s and heavy.starved > 0.2
    assert heavy.throughput_tok_s < 80 * 8  # capped by the server, below what was offered


@settings(max_examples=10, deadline=None)
@given(rate=st.floats(1, 20), seed=st.integers(0, 99), bursty=st.booleans())
def test_generated_workloads_fit_the_context(rate, seed, bursty):
    s = AdapterSet.zipf(10, 1.2, seed=seed)
    w = generate(s, rate=rate, duration_s=30, seed=seed, bursty=bursty)
    assert all(1 <= a.prompt_len <= PROMPT_MAX and 1 <= a.gen_len <= GEN_MAX for a in w)
    assert all(a.prompt_len + a.gen_len <= serve_model().seq_len for a in w)
    assert [a.t for a in w] == sorted(a.t for a in w) and all(0 <= a.t < 30 for a in w)
    if not bursty:
        assert 0.5 * rate * 30 < len(w) < 1.5 * rate * 30


def test_trace_rescaled_to_rate_and_zipf_popularity():
    s = AdapterSet.zipf(8, 1.2, seed=0)
    assert list(s.popularity) == sorted(s.popularity, reverse=True) and abs(sum(s.popularity) - 1) < 1e-9
    w = from_trace("conv", s, rate=5.0, duration_s=60, seed=0)
    assert 0.5 * 300 < len(w) < 1.5 * 300
    counts = np.bincount([s.names.index(a.adapter) for a in w], minlength=8)
    assert counts[0] > counts[-1]


class _Capacity:
    """A stand-in model: a server keeps up while its rate is under 3 req/s."""

    def predict(self, adapters, rate, lengths):
        return {"p_ok": 1.0 if rate < 3 else 0.0}


def test_greedy_packs_by_the_model_and_baselines_spread():
    s = AdapterSet.zipf(12, 1.0, seed=0)
    cfg = ServeConfig()
    for rate, want in ((2.0, 1), (5.0, 2), (8.0, 3)):
        p = greedy(_Capacity(), cfg, s, rate, 4, lengths=(10.0, 8.0))
        assert servers_used(p) == want and sorted(sum(p, [])) == sorted(s.names)
    assert servers_used(round_robin(s, 3)) == 3 and sorted(sum(random_placement(s, 3, 0), [])) == sorted(s.names)


def test_forest_learns_the_twin():
    cfg = ServeConfig(max_batch=4, slots=2)
    kw = dict(slo_s=1.0, duration_s=10, max_adapters=12, max_rate=40)
    x, y = twin_dataset(cfg, COSTS, n=120, seed=0, **kw)
    xt, yt = twin_dataset(cfg, COSTS, n=30, seed=1, **kw)
    pred = PerfModel.train(x, y).predict_many(xt)
    err = np.mean(np.abs(pred[:, 0] - yt[:, 0]) / yt[:, 0])
    assert err < 0.25, err


def _profile_log(rng, n=300, preempt=0.0):
    """Iteration records with known CPU costs, every fourth the first after idleness; `preempt`: the
    chance that a later iteration loses 20 ms of wall time to another process (CPU unchanged)."""
    log = []
    for i in range(n):
        b, length = int(rng.integers(1, 9)), int(rng.integers(2, 64))
        r, k = int(rng.choice([0, 4, 16])), int(rng.integers(0, 3))
        cpu = (COSTS.iteration(b, length, r) + k * COSTS.load) * (1 + 0.01 * rng.standard_normal())
        fresh = i % 4 == 0
        lost = 0.02 if not fresh and rng.random() < preempt else 0.0
        log.append((b, length, r, k, cpu + lost, cpu, 0.0 if fresh else 0.05))
    return log


def test_profile_fit_recovers_known_costs():
    from unbroken.serve.profile import fit

    admissions = [(0.001, 0.002), (0.002, None), (0.003, 0.004)]
    got = fit(_profile_log(np.random.default_rng(0)), [0.003, 0.004, 0.005], admissions)
    assert abs(got.token - COSTS.token) / COSTS.token < 0.05 and abs(got.base - COSTS.base) / COSTS.base < 0.1
    assert abs(got.load - COSTS.load) / COSTS.load < 0.2 and got.http == 0.004
    assert got.dispatch == 0.002 and got.wake == 0.003
    assert 0.95 < min(got.slowdown) <= max(got.slowdown) < 1.05  # nothing else ran: wall = CPU


def test_profile_fit_keeps_the_cost_shape_and_the_spread_under_preemption():
    """A third of the iterations preempted: the CPU shape is still recovered (a fit of wall times
    would fold the preemptions into the per-iteration base), and the slowdown quantiles carry them,
    so the twin's mean iteration matches the profiled mean wall time while its median stays typical."""
    from unbroken.serve.profile import fit

    log = _profile_log(np.random.default_rng(1), n=600, preempt=1 / 3)
    got = fit(log, [0.004])
    assert abs(got.token - COSTS.token) / COSTS.token < 0.05 and abs(got.base - COSTS.base) / COSTS.base < 0.1
    wall = np.array([rec[4] for rec in log])
    pred = np.array([got.iteration(b, length, r) + k * got.load for b, length, r, k, *_ in log])
    factors = np.array(got.slowdown)
    mean_factor = 0.75 * np.mean(factors) + 0.25 * np.mean(got.slowdown_fresh)  # a quarter are fresh
    assert abs(mean_factor * pred.mean() - wall.mean()) / wall.mean() < 0.1
    assert np.median(factors) < 1.1 and factors.max() > 1.5
    assert max(got.slowdown_fresh) < 1.05  # the first iterations after idleness were never preempted


def test_twin_adds_the_hand_off_and_wake_up_to_a_lone_request():
    s = AdapterSet.zipf(2, 1.0, seed=0)
    one = [Arrival(0.0, s.names[0], 4, 3)]
    cfg = ServeConfig(max_batch=4, slots=2)
    base, b = simulate(cfg, s, one, COSTS, slo_s=1.0)
    late = Costs(**{**COSTS.as_dict(), "dispatch": 0.003, "wake": 0.002})
    later, c = simulate(cfg, s, one, late, slo_s=1.0)
    assert abs((later.p50_s - base.p50_s) - 0.005) < 1e-9
    slow = Costs(**{**COSTS.as_dict(), "slowdown": (2.0,), "slowdown_fresh": (3.0,)})
    slower, _ = simulate(cfg, s, one, slow, slo_s=1.0)
    r = s.ranks[0]
    first, rest = COSTS.iteration(1, 4, r) + COSTS.load, COSTS.iteration(1, 5, r) + COSTS.iteration(1, 6, r)
    assert abs((base.p50_s - COSTS.http) - (first + rest)) < 1e-9
    assert abs((slower.p50_s - COSTS.http) - (3 * first + 2 * rest)) < 1e-9
    assert b["requests"][0][1] == COSTS.http / 2 and c["requests"][0][1] == COSTS.http / 2 + 0.005


def test_greedy_spreads_load_over_the_servers_it_needs():
    s = AdapterSet.zipf(12, 1.0, seed=0)
    p = greedy(_Capacity(), ServeConfig(), s, 5.0, 4, lengths=(10.0, 8.0))
    shares = [sum(s.popularity[s.names.index(n)] for n in h) for h in p]
    assert len(p) == 2 and max(shares) - min(shares) < 0.2  # not one full server and one nearly idle


def test_a_profile_keeps_only_what_was_logged_since_its_first_look():
    from unbroken.serve.profile import log_since

    before = {"iterations": [[1], [2]], "iterations_total": 2}
    after = {"iterations": [[1], [2], [3], [4]], "iterations_total": 4}
    assert log_since(before, after, "iterations") == [[3], [4]]
    assert log_since(after, after, "iterations") == []
    rolled = {"iterations": [[4], [5]], "iterations_total": 5}  # the server keeps its 2 most recent
    assert log_since(after, rolled, "iterations") == [[5]]
    with pytest.raises(AssertionError, match="look more often"):
        log_since(before, rolled, "iterations")
