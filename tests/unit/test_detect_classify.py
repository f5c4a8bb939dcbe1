"""Classification table, the offender exclusion policy, and the retry chain."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.detect.classify import Decision, ExclusionPolicy, OffenderTable, classify
from unbroken.detect.detectors import Finding
from unbroken.detect.retry import Attempt, RetryChain, RetryPolicy


def finding(fault: str, node: int | None = 1, t: float = 0.0, rank: int | None = 2, **ev) -> Finding:
    return Finding(fault=fault, proc=f"w{rank}", rank=rank, node=node, time=t, evidence=ev)


@pytest.mark.parametrize("fault, cls, action", [
    ("crash", "operable", "in_place"), ("hang", "operable", "in_place"),
    ("exception", "operable", "in_place"), ("numerics", "operable", "in_place"),
    ("stall", "operable", "in_place"), ("straggler", "replace", "exclude_node"),
    ("health", "replace", "exclude_node"),
])
def test_first_fault_classification_table(fault, cls, action):
    d = classify(finding(fault, ratio=1.9, windows=3, window_steps=10, probe="nvidia-smi", problems=["ECC"]),
                 OffenderTable())
    assert (d.fault, d.cls, d.action) == (fault, cls, action)
    assert d.exclude == (action == "exclude_node") and d.reason
    assert d.event_fields()["action"] == action and d.event_fields()["node"] == 1


def test_repeated_failures_on_one_node_replace_it():
    table = OffenderTable(ExclusionPolicy(max_faults=3, window_s=100.0))
    decisions = [classify(finding("crash", t=t), table) for t in (0.0, 10.0, 20.0)]
    assert [d.action for d in decisions] == ["in_place", "in_place", "exclude_node"]
    assert "3 faults within 100 s" in decisions[-1].reason and table.is_excluded(1)
    assert table.exclude(1, 20.0) == {"node": 1, "faults": 3, "window_s": 100.0}
    later = classify(finding("crash", t=30.0), table)
    assert (later.cls, later.action) == ("replace", "none") and "already excluded" in later.reason


def test_faults_outside_the_window_do_not_count():
    table = OffenderTable(ExclusionPolicy(max_faults=2, window_s=60.0))
    assert classify(finding("hang", t=0.0), table).action == "in_place"
    assert classify(finding("hang", t=61.0), table).action == "in_place"     # the first one aged out
    assert classify(finding("hang", t=100.0), table).action == "exclude_node"
    assert table.rows(100.0) == [{"node": 1, "in_window": 2, "total": 3, "by_fault": {"hang": 3}, "excluded": True}]


def test_recording_a_finding_twice_counts_once():
    table = OffenderTable(ExclusionPolicy(max_faults=2, window_s=60.0))
    f = finding("crash", t=5.0)
    assert table.record(f) == 1 and table.record(f) == 1
    assert not table.must_exclude(1, 5.0)


def test_a_fault_without_a_node_is_never_counted():
    table = OffenderTable(ExclusionPolicy(max_faults=1, window_s=60.0))
    d = classify(finding("stall", node=None, rank=None), table)
    assert (d.cls, d.action, d.exclude) == ("operable", "in_place", False)
    assert table.rows(0.0) == []


def test_when_the_node_cannot_go_or_tier1_cannot_rebuild():
    d = classify(finding("straggler", ratio=2.0), OffenderTable(), can_exclude=False)
    assert (d.cls, d.action, d.exclude) == ("replace", "in_place", False) and "cannot be excluded" in d.reason
    d = classify(finding("crash"), OffenderTable(), tier1_ok=False)
    assert (d.cls, d.action) == ("operable", "tier2") and "tier 2" in d.reason
    table = OffenderTable()
    d = classify(finding("health", problems=["GPU 0: hung"]), table, tier1_ok=False)
    assert (d.cls, d.action, d.exclude) == ("replace", "tier2", True) and table.is_excluded(1)


@settings(max_examples=60, deadline=None)
@given(times=st.lists(st.floats(min_value=0, max_value=1000), min_size=1, max_size=30),
       max_faults=st.integers(1, 6), window=st.floats(min_value=1, max_value=500))
def test_exclusion_policy_matches_a_naive_count(times, max_faults, window):
    table = OffenderTable(ExclusionPolicy(max_faults=max_faults, window_s=window))
    times = sorted(times)
    for i, t in enumerate(times):
        table.record(Finding(fault="crash", proc=f"w{i}", rank=0, node=7, time=t))
    now = times[-1]
    naive = sum(1 for t in times if now - window < t <= now)
    assert table.count(7, now) == naive
    assert table.must_exclude(7, now) == (naive >= max_faults)


@pytest.mark.parametrize("kw, msg", [({"max_faults": 0}, "max_faults"), ({"window_s": 0}, "window_s"),
                                     ({"window_s": float("inf")}, "window_s")])
def test_exclusion_policy_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ExclusionPolicy(**kw)


# --- retry chain -----------------------------------------------------------------------------
policies = st.builds(RetryPolicy, budget=st.integers(1, 8), base_backoff_s=st.floats(0, 5),
                     factor=st.floats(1, 4), max_backoff_s=st.floats(0, 60), escalate_after=st.integers(1, 8))


@settings(max_examples=80, deadline=None)
@given(policy=policies, outcomes=st.lists(st.sampled_from(["ok", "failed"]), min_size=8, max_size=8))
def test_retry_chain_backoff_budget_and_escalation(policy, outcomes):
    chain = RetryChain(policy, action="in_place", fault="crash")
    attempts: list[Attempt] = []
    for a, outcome in zip(chain, outcomes):
        attempts.append(a)
        link = chain.record(a, outcome)
        assert link["attempt"] == a.attempt and link["of"] == policy.budget and link["outcome"] == outcome
    n = len(attempts)
    assert 1 <= n <= policy.budget
    assert [a.attempt for a in attempts] == list(range(1, n + 1))
    backoffs = [a.backoff_s for a in attempts]
    assert backoffs[0] == 0.0 and backoffs == sorted(backoffs) and max(backoffs) <= policy.max_backoff_s
    # the chain stops at the first success, or when the budget is spent
    first_ok = next((i for i, o in enumerate(outcomes) if o == "ok"), None)
    assert n == (first_ok + 1 if first_ok is not None and first_ok < policy.budget else policy.budget)
    assert chain.succeeded == (first_ok is not None and first_ok < policy.budget) and chain.done
    # after escalate_after failures the fallback takes over
    assert [a.action for a in attempts] == ["in_place" if i < policy.escalate_after else "tier2" for i in range(n)]
    assert chain.links[-1]["final"] and not any(x["final"] for x in chain.links[:-1])


def test_retry_backoff_sequence_is_exponential_and_capped():
    p = RetryPolicy(budget=6, base_backoff_s=0.5, factor=2.0, max_backoff_s=3.0)
    assert [p.backoff(k) for k in range(1, 7)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]


def test_retry_chain_insists_on_outcomes_in_order():
    chain = RetryChain(RetryPolicy(budget=2), action="exclude_node")
    a = chain.next_attempt()
    with pytest.raises(AssertionError, match="record the outcome"):
        chain.next_attempt()
    with pytest.raises(ValueError, match="outcome"):
        chain.record(a, "maybe")
    assert chain.record(a, "ok", seconds=0.4)["seconds"] == 0.4
    assert chain.next_attempt() is None


@pytest.mark.parametrize("kw, msg", [({"budget": 0}, "budget"), ({"factor": 0.5}, "factor"),
                                     ({"base_backoff_s": -1}, "base_backoff_s"), ({"fallback": "reboot"}, "fallback"),
                                     ({"escalate_after": 0}, "escalate_after")])
def test_retry_policy_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        RetryPolicy(**kw)


def test_decision_event_fields_are_what_the_report_reads():
    d = Decision(fault="crash", cls="operable", action="in_place", reason="r", proc="w2", rank=2, node=1)
    assert d.event_fields() == {"fault": "crash", "cls": "operable", "action": "in_place", "reason": "r",
                                "proc": "w2", "node": 1, "exclude": False}
