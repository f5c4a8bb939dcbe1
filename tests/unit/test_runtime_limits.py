"""Pure logic of issue 12's runtime limits: the recovery rate limit, node leases, the
shadow pool's sizing, the repeated-exception fingerprint, and the new config fields."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.config import ConfigError, RunConfig
from unbroken.runtime.budget import RecoveryRateExceeded, RecoveryRateLimit
from unbroken.runtime.crash import fingerprint
from unbroken.runtime.lease import NodeLeases
from unbroken.runtime.pool import ShadowPoolSizer


@settings(max_examples=200, deadline=None)
@given(per_hour=st.integers(1, 6), gaps=st.lists(st.floats(0, 2000), min_size=1, max_size=40))
def test_the_rate_limit_admits_exactly_per_hour_in_any_window(per_hour, gaps):
    lim, t, admitted = RecoveryRateLimit(per_hour), 0.0, []
    for g in gaps:
        t += g
        recent = [a for a in admitted if a > t - 3600]
        if len(recent) >= per_hour:
            with pytest.raises(RecoveryRateExceeded, match="max-recoveries-per-hour"):
                lim.admit(t)
        else:
            lim.admit(t)
            admitted.append(t)


def test_a_zero_rate_means_no_limit():
    lim = RecoveryRateLimit(0)
    for i in range(1000):
        lim.admit(float(i))


class _Store:
    def __init__(self):
        self.v = {}

    def add(self, key, n):
        self.v[key] = self.v.get(key, 0) + n
        return self.v[key]


def test_a_node_that_stops_renewing_is_lost_once_and_others_are_not():
    now = [0.0]
    store, leases = _Store(), NodeLeases(3, 1.0, clock=lambda: now[0])
    for _ in range(5):
        now[0] += 0.3
        store.add("lease/1", 1)
        store.add("lease/2", 1)
        assert leases.observe(store) == []
    lost = []
    for _ in range(6):  # node 2 goes quiet; node 1 keeps renewing
        now[0] += 0.3
        store.add("lease/1", 1)
        lost += leases.observe(store)
    assert [n for n, _ in lost] == [2] and leases.lost == {2} and lost[0][1] > 1.0
    assert not leases.late(0.5)  # node 1 is live and current; node 2 no longer counts
    seen = leases.read(store)  # e.g. when a collective error is seen
    assert seen == {1: store.v["lease/1"]} and not leases.renewed_after(store, seen)
    store.add("lease/1", 1)
    assert leases.renewed_after(store, seen)


def test_the_pool_grows_when_failures_outpace_warmup_and_is_capped():
    pool = ShadowPoolSizer(4)
    pool.warmed_up(3.0)
    assert pool.failure(0.0) is None  # one failure says nothing about the rate
    assert pool.failure(1.5) == 3  # 3 s warm-up / 1.5 s apart -> 2 in flight, +1
    assert pool.failure(1.6) is None or pool.size == 4
    assert pool.size <= 4


def test_rare_failures_keep_one_shadow():
    pool = ShadowPoolSizer(4)
    pool.warmed_up(2.0)
    for t in (0.0, 100.0, 200.0):
        pool.failure(t)
    assert pool.size == 1


def _raise(msg):
    raise KeyError(msg)


def test_the_fingerprint_names_type_message_line_and_step():
    fps = []
    for msg, step in (("a", 3), ("a", 3), ("b", 3), ("a", 4)):
        try:
            _raise(msg)
        except KeyError as e:
            fps.append(fingerprint(e, step))
    assert fps[0] == fps[1] and len(set(fps)) == 3


@pytest.mark.parametrize("field,value,needle", [
    ("retry_budget", 0, "retry_budget"), ("max_recoveries_per_hour", -1, "max_recoveries_per_hour"),
    ("on_nonfinite", "ignore", "on_nonfinite"), ("nonfinite_retries", -1, "nonfinite_retries"),
    ("shadows", "many", "shadows"), ("node_lease_s", 0.2, "node_lease_s")])
def test_bad_limits_are_refused_naming_the_field(field, value, needle):
    with pytest.raises(ConfigError, match=needle):
        RunConfig(**{field: value})


def test_auto_shadows_count_their_maximum_in_the_memory_budget():
    assert RunConfig(shadows="auto", max_shadows=3).shadow_pool_max == 3
    assert RunConfig(shadows=2).shadow_pool_max == 2


def test_only_the_scripts_own_exceptions_are_judged_as_software_faults():
    from unbroken.protect.txn import TxnLog
    from unbroken.runtime.crash import raised_by_script

    def script_bug():
        return {}["missing"]

    for call, mine in ((script_bug, True), (lambda: TxnLog(2, 0).commit_chunk(0, 5), False)):
        try:
            call()
        except (KeyError, AssertionError) as e:  # the second: unbroken's internal check failing
            assert raised_by_script(e) is mine


class _KV:
    def __init__(self, **kv):
        self.kv = {k.replace("_", "/", 1): json.dumps(v) for k, v in kv.items()}

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def get(self, k):
        return self.kv[k].encode()

    def delete_key(self, k):
        self.kv.pop(k, None)


class _Events:
    def __init__(self):
        self.got = []

    def emit(self, kind, **f):
        self.got.append((kind, f))


def test_the_same_exception_counts_once_per_generation():
    from unbroken.runtime.crash import CrashJudge, SoftwareFault

    rec = {"step": 3, "error": "KeyError: 'x'", "fingerprint": "f1", "traceback": "tb"}
    ev = _Events()
    judge = CrashJudge(_KV(), ev)
    for proc in ("a", "b", "c"):  # three ranks hit it in the same step of generation 0: one occurrence
        judge.store = _KV(**{f"crash_{proc}": {**rec, "gen": 0}})
        judge.judge(proc)
    judge.store = _KV(crash_d={**rec, "gen": 1})  # and again after the recovery: the script's bug
    with pytest.raises(SoftwareFault, match="same exception at step 3"):
        judge.judge("d")
    assert ev.got[-1][0] == "software_fault" and ev.got[-1][1]["occurrences"] == 2
