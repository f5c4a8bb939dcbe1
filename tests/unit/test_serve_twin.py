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


def test_profile_fit_recovers_known_costs():
    from unbroken.serve.profile import fit

    rng = np.random.default_rng(0)
    log = []
    for _ in range(300):
        b, length, r, n = int(rng.integers(1, 9)), int(rng.integers(2, 64)), int(rng.choice([0, 4, 16])), int(rng.integers(0, 3))
        t = COSTS.iteration(b, length, r) + n * COSTS.load
        log.append((b, length, r, n, t * (1 + 0.01 * rng.standard_normal())))
    got = fit(log, [0.003, 0.004, 0.005])
    assert abs(got.token - COSTS.token) / COSTS.token < 0.05 and abs(got.base - COSTS.base) / COSTS.base < 0.1
    assert abs(got.load - COSTS.load) / COSTS.load < 0.2 and got.http == 0.004


def test_greedy_spreads_load_over_the_servers_it_needs():
    s = AdapterSet.zipf(12, 1.0, seed=0)
    p = greedy(_Capacity(), ServeConfig(), s, 5.0, 4, lengths=(10.0, 8.0))
    shares = [sum(s.popularity[s.names.index(n)] for n in h) for h in p]
    assert len(p) == 2 and max(shares) - min(shares) < 0.2  # not one full server and one nearly idle
