"""Simulator model: analytic checks, Young/Daly, reproducibility, accounting, tier-2 rules, rates files."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from unbroken.sim import SimError, default_mix, load_mix, make_policy, run_policy
from unbroken.sim._reference import naive_locate
from unbroken.sim.cluster import Cluster, Trace, make_trace
from unbroken.sim.costs import JobRestart, Workload, daly_interval, ettr_checkpoint_restart, young_interval
from unbroken.sim.engine import ACCOUNTS, _Grid
from unbroken.sim.montecarlo import mean_ci95, monte_carlo, sweep_sizes
from unbroken.sim.policies import POLICY_NAMES, CkptRestart, ReplicaHeal, Schedule, Unbroken, parse_policies
from unbroken.sim.rates import FailureClass, FailureMix

FAST = settings(max_examples=40, deadline=None, derandomize=True)  # CI must not meet a new float tie by chance
W = Workload()


def _one_class(count: float = 8.0, gpus: int = 1024, **kw) -> FailureMix:
    """One operable class, `count` failures per day on `gpus` GPUs."""
    return FailureMix(gpus=gpus, days=1, classes=(FailureClass(name="x", count=count, kind="operable", **kw),))


def _trace(times, nodes, cls=None, gpu=None) -> Trace:
    n = len(times)
    return Trace(times=np.asarray(times, float), cls=np.asarray(cls or [0] * n), node=np.asarray(nodes),
                 gpu=np.asarray(gpu or [0] * n))


# --- the default mix ----------------------------------------------------------------------------------


def test_llama3_mix_implies_three_hour_mttf_at_16k():
    mix = default_mix()
    assert mix.total == 419 and mix.gpus == 16384 and mix.days == 54
    assert mix.mttf_hours(16384) == pytest.approx(54 * 24 / 419)  # 3.09 h
    assert 2.9 < mix.mttf_hours(16384) < 3.3
    assert mix.mttf_hours(131072) == pytest.approx(mix.mttf_hours(16384) / 8)  # linear in GPU count
    by = {c.name: c for c in mix.classes}
    assert by["gpu"].count == 148 and by["hbm3"].count == 72 and by["software"].kind == "operable"
    assert by["sdc"].corrupts_state and sum(c.corrupts_state for c in mix.classes) == 1


# --- analytic checks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("interval_s,save_s,mttf_h", [(1800, 120, 3.0), (600, 30, 1.0), (None, 60, 0.5)])
def test_ckpt_restart_matches_closed_form_within_2_percent(interval_s, save_s, mttf_h):
    mix = _one_class(count=24 / mttf_h)
    cluster = Cluster(gpus=1024, days=400, spares=10)
    restart = JobRestart(detect_s=60, reschedule_s=120, relaunch_per_log2_s=5)
    pol = CkptRestart(interval_s=interval_s, save_s=save_s, restart=restart)
    m = mttf_h * 3600
    tau = interval_s or daly_interval(save_s, m)
    r_s = 60 + 120 + 5 * math.log2(1024) + W.storage_s
    expected = ettr_checkpoint_restart(tau, save_s, r_s, m)
    sim = np.mean([run_policy(pol, cluster, mix, W, s).ettr for s in range(3)])
    assert abs(sim - expected) / expected < 0.02, (sim, expected)


def test_daly_interval_is_the_argmax_of_simulated_ettr():
    mix, cluster, save_s = _one_class(count=8), Cluster(gpus=1024, days=1500, spares=10), 120.0
    daly = daly_interval(save_s, 3 * 3600)
    trace = make_trace(cluster, mix, 7)  # one trace for every interval: differences are not noise
    factors = (0.4, 0.6, 0.8, 1.0, 1.25, 1.6, 2.5)
    ettr = {f: run_policy(CkptRestart(interval_s=f * daly, save_s=save_s), cluster, mix, W, 7, trace=trace).ettr
            for f in factors}
    best = max(ettr, key=ettr.get)
    assert 0.6 <= best <= 1.6, ettr
    assert ettr[1.0] >= ettr[best] - 0.002, ettr
    assert daly == pytest.approx(young_interval(save_s, 3 * 3600), rel=0.1)


def test_daly_falls_back_to_mttf_when_saving_costs_more_than_two_mttf():
    assert daly_interval(100.0, 40.0) == 40.0


# --- reproducibility and accounting -------------------------------------------------------------------


def test_a_seed_reproduces_a_run_and_policies_share_the_trace():
    mix, cluster = default_mix(), Cluster(gpus=16384, days=10)
    a = run_policy(make_policy("unbroken"), cluster, mix, W, 3)
    b = run_policy(make_policy("unbroken"), cluster, mix, W, 3)
    c = run_policy(make_policy("unbroken"), cluster, mix, W, 4)
    assert a == b and a.time_s != c.time_s
    t1, t2 = make_trace(cluster, mix, 3), make_trace(cluster, mix, 3)
    assert np.array_equal(t1.times, t2.times) and np.array_equal(t1.node, t2.node)
    assert run_policy(make_policy("ckpt-restart"), cluster, mix, W, 3).failures == a.failures == len(t1)


@FAST
@given(name=st.sampled_from(POLICY_NAMES), gpus_log2=st.integers(6, 15), days=st.floats(0.2, 10),
       seed=st.integers(0, 10**6), spares=st.integers(0, 3), step_s=st.floats(0.5, 60),
       count=st.floats(0.5, 50))
def test_every_wall_second_is_accounted_once(name, gpus_log2, days, seed, spares, step_s, count):
    mix = FailureMix(gpus=1024, days=1, classes=(
        FailureClass(name="a", count=count, kind="replace"),
        FailureClass(name="b", count=count / 3, kind="operable"),
        FailureClass(name="c", count=count / 50, kind="replace", corrupts_state=True)))
    cluster = Cluster(gpus=2 ** gpus_log2, days=days, spares=spares, provision_s=300)
    r = run_policy(make_policy(name), cluster, mix, Workload(step_s=step_s), seed)
    assert set(r.time_s) == set(ACCOUNTS)
    assert all(v >= -1e-6 for v in r.time_s.values()), r.time_s
    assert sum(r.time_s.values()) == pytest.approx(r.wall_s, rel=1e-9)
    assert 0.0 <= r.ettr <= 1.0


@FAST
@given(tau=st.floats(0.5, 50), fast_cost=st.floats(0, 5), slow_cost=st.floats(0, 50), every=st.integers(1, 7),
       i0=st.integers(0, 40), dt=st.floats(0, 2000))
def test_closed_form_schedule_walk_matches_the_naive_one(tau, fast_cost, slow_cost, every, i0, dt):
    s = Schedule(fast_interval_s=tau, fast_cost_s=fast_cost, slow_every=every, slow_cost_s=slow_cost)
    p, fast_i, slow_i = _Grid(s).locate(i0, dt)
    q, fast_j, slow_j = naive_locate(s, i0, dt)
    assume(abs(p - q) < tau / 2)  # skip float ties at an exact segment boundary
    # zero-length segments (dt = 0, a free checkpoint) make the boundary itself a tie: either
    # side's count is right there
    assume(dt > 1e-9 and slow_cost > 0 and fast_cost > 0)  # a subnormal dt is a boundary tie too
    assert p == pytest.approx(q, abs=1e-6) and (fast_i, slow_i) == (fast_j, slow_j)


def test_no_failures_leaves_only_the_save_cost():
    mix, cluster = _one_class(count=1e-9), Cluster(gpus=8, days=1)
    r = run_policy(CkptRestart(interval_s=100.0, save_s=25.0), cluster, mix, W, 0)
    assert r.failures == 0 and r.ettr == pytest.approx(100 / 125, abs=2e-3)


# --- recovery rules -----------------------------------------------------------------------------------


def _manual(policy, times, nodes, mix=None, cls=None, **cluster_kw):
    mix = mix or _one_class(count=1e-9)
    cluster = Cluster(gpus=1024, days=1, **cluster_kw)
    return run_policy(policy, cluster, mix, W, 0, trace=_trace(times, nodes, cls), record=True)


def test_second_failure_in_the_same_parity_group_falls_back_to_tier2():
    pol = Unbroken(parity_group=4)  # 128 nodes -> 32 groups; nodes 5 and 37 share group 5
    same = _manual(pol, [10_000.0, 10_005.0], [5, 37])
    other = _manual(pol, [10_000.0, 10_005.0], [5, 6])
    later = _manual(pol, [10_000.0, 20_000.0], [5, 37])
    assert same.tier2 == 1 and other.tier2 == 0 and later.tier2 == 0
    assert same.time_s["redo"] > other.time_s["redo"]
    assert [f[4] for f in same.incidents[0].faults] == ["in_place", "tier2"]


def test_silent_corruption_falls_back_to_tier2_for_every_fast_policy():
    mix = FailureMix(gpus=1024, days=1, classes=(FailureClass(name="sdc", count=1e-9, kind="replace",
                                                              corrupts_state=True),))
    for name in ("in-memory", "replica-heal", "unbroken"):
        assert _manual(make_policy(name), [5000.0], [3], mix=mix).tier2 == 1


def test_an_empty_spare_pool_costs_the_provisioning_wait():
    mix = FailureMix(gpus=1024, days=1, classes=(FailureClass(name="gpu", count=1e-9, kind="replace"),))
    r = _manual(Unbroken(), [1000.0, 5000.0, 9000.0], [1, 2, 3], mix=mix, spares=1, provision_s=700.0)
    assert r.time_s["wait"] == pytest.approx(1400.0)
    assert _manual(Unbroken(), [1000.0], [1], spares=0, provision_s=700.0).time_s["wait"] == 0  # operable


def test_replica_heal_degraded_time_is_not_cancelled_by_a_second_failure():
    pol = ReplicaHeal(replicas=8)
    one = _manual(pol, [1000.0], [1])
    two = _manual(pol, [1000.0, 1040.0], [1, 90])
    assert two.time_s["degraded"] == pytest.approx(2 * one.time_s["degraded"])
    assert one.time_s["degraded"] > 0 and one.tier2 == 0


def test_unbroken_keeps_training_productive_at_131k():
    mix, cluster = default_mix(), Cluster(gpus=131072, days=30)
    pols = {n: make_policy(n) for n in POLICY_NAMES}
    s = {x.policy: x for x in monte_carlo(pols, cluster, mix, W, seeds=3)}
    assert s["unbroken"].ettr_gross >= 0.95  # before its own overhead; net, the uncalibrated 16% costs it
    assert s["unbroken"].ettr == pytest.approx(s["unbroken"].ettr_gross / 1.16, rel=1e-9)
    assert s["ckpt-restart"].ettr < s["in-memory"].ettr_gross < s["unbroken"].ettr_gross
    assert s["ckpt-restart"].ettr < s["unbroken"].ettr < s["replica-heal"].ettr
    assert s["unbroken"].failures == s["ckpt-restart"].failures > 1500
    assert s["unbroken"].ettr_low <= s["unbroken"].ettr <= s["unbroken"].ettr_high


# --- helpers and configs ------------------------------------------------------------------------------


def test_confidence_interval_and_sweep_sizes():
    m, lo, hi = mean_ci95([1.0, 2.0, 3.0])
    assert m == 2.0 and hi - m == pytest.approx(4.303 * 1 / math.sqrt(3), rel=1e-3) and lo < m
    assert mean_ci95([0.5]) == (0.5, 0.5, 0.5)
    assert sweep_sizes(131072, 8) == [1024 * 2 ** k for k in range(8)]
    assert sweep_sizes(3000, 6) == [1020, 2046, 3000]


def test_policy_names_and_configs_reject_bad_values():
    assert parse_policies("all") == list(POLICY_NAMES)
    assert parse_policies("unbroken, ckpt-restart") == ["unbroken", "ckpt-restart"]
    with pytest.raises(SimError, match="unknown policy 'nope'"):
        parse_policies("nope")
    with pytest.raises(SimError, match="replicas must be an integer >= 2"):
        ReplicaHeal(replicas=1)
    with pytest.raises(SimError, match="interval_s must be a number > 0"):
        CkptRestart(interval_s=-5)
    with pytest.raises(SimError, match="does not divide"):
        Cluster(gpus=1000, node_size=7)
    with pytest.raises(SimError, match="overlap must be in"):
        Workload(overlap=1.0)
    with pytest.raises(SimError, match="parity_group .* needs that many nodes"):
        run_policy(Unbroken(parity_group=8), Cluster(gpus=16), _one_class(), W, 0)
    assert dataclasses.replace(Unbroken(), protect_every=3).protect_every == 3


@pytest.mark.parametrize("body,match", [
    ("{not json", "not valid JSON"),
    ("[]", "expected a JSON object"),
    ('{"gpus": 8, "days": 1}', "missing key 'classes'"),
    ('{"gpus": 8, "days": 1, "classes": [{"name": "a", "count": 0, "kind": "replace"}]}', "count must be a number > 0"),
    ('{"gpus": 8, "days": 1, "classes": [{"name": "a", "count": -3, "kind": "replace"}]}', "count must be a num"),
    ('{"gpus": 8, "days": 0, "classes": [{"name": "a", "count": 1, "kind": "replace"}]}', "'days'"),
    ('{"gpus": 8, "days": 1, "classes": [{"name": "a", "count": 1, "kind": "broken"}]}', "kind must be one of"),
    ('{"gpus": 8, "days": 1, "classes": [{"name": "a", "count": 1, "kind": "replace", "x": 1}]}', "unknown key"),
    ('{"gpus": 8, "days": 1, "classes": [{"name": "a", "count": 1, "kind": "replace"}, '
     '{"name": "a", "count": 2, "kind": "operable"}]}', "unique"),
])
def test_bad_rates_files_are_rejected_with_the_reason(tmp_path, body, match):
    p = tmp_path / "rates.json"
    p.write_text(body)
    with pytest.raises(SimError, match=match):
        load_mix(p)


def test_rates_file_round_trip_and_unreadable_path(tmp_path):
    p = tmp_path / "mix.json"
    p.write_text(json.dumps({"gpus": 100, "days": 10, "classes": [
        {"name": "gpu", "count": 24, "kind": "replace"}, {"name": "sw", "count": 24, "kind": "operable"}]}))
    mix = load_mix(p)
    assert mix.mttf_hours(100) == pytest.approx(5.0)
    with pytest.raises(SimError, match="cannot read rates file"):
        load_mix(tmp_path / "missing.json")
    with pytest.raises(SimError, match="cannot read rates file"):
        load_mix(tmp_path)


def test_replica_heal_waits_for_a_node_while_the_other_groups_train():
    mix = FailureMix(gpus=1024, days=1, classes=(FailureClass(name="gpu", count=1e-9, kind="replace"),))
    base = _manual(ReplicaHeal(replicas=4), [1000.0], [1], mix=mix, spares=5)
    short = _manual(ReplicaHeal(replicas=4), [1000.0], [1], mix=mix, spares=0, provision_s=800.0)
    assert short.time_s["wait"] == 0
    assert short.time_s["degraded"] - base.time_s["degraded"] == pytest.approx(800.0 / 4)
