"""Overlap plans: validation of --overlap and plan files, the core partition, the tuning cache's key."""
from __future__ import annotations

import json
import os
import threading
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch

from unbroken.config import ConfigError, ModelConfig, RunConfig
from unbroken.parallel.overlap import (FORMAT, OverlapPlan, Partition, PlanError, ThreadPinner, available_cores,
                                       plan_file_text, read_plan_file)
from unbroken.runtime import membership
from unbroken.runtime.overlap_tune import STORE_KEY, OverlapControl, cache_path, checked_overlap, leads, tuning_key

linux_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="per-thread affinity is Linux's")


def test_overlap_mode_is_checked_at_construction(tmp_path):
    for good in ("on", "off", "auto", str(tmp_path / "p.json")):
        assert RunConfig(overlap=good).overlap == good
    for bad, needle in (("sometimes", "one of on, off, auto"), (str(tmp_path), "one of"),
                        (str(tmp_path / "no" / "p.json"), "does not exist"), (3, "one of")):
        with pytest.raises(ConfigError, match=needle):
            RunConfig(overlap=bad)


def test_plan_rejects_a_bucket_size_below_one_and_unknown_partitions():
    for kb in (0, -4, 1.5, True):
        with pytest.raises(PlanError, match="bucket_kb must be an integer >= 1"):
            OverlapPlan(bucket_kb=kb)
    with pytest.raises(PlanError, match="first_bucket_kb must be an integer >= 1"):
        OverlapPlan(first_bucket_kb=0)
    # the first bucket is never larger than the others; an old plan file (no first bucket) gets 1 MiB
    assert OverlapPlan(bucket_kb=64).bucket_sizes == (64 * 256, 64 * 256)
    assert OverlapPlan(bucket_kb=25600).bucket_sizes == (25600 * 256, 1024 * 256)
    assert OverlapPlan.from_dict({"bucket_kb": 4096}, source="file").first_bucket_kb == 1024
    with pytest.raises(PlanError, match="partition must be one of"):
        Partition(name="half")
    with pytest.raises(PlanError, match="takes no core lists"):
        Partition(name="split", compute_cores=(0,))
    with pytest.raises(PlanError, match="collectives must be one of"):
        OverlapPlan(collectives="ring")
    assert OverlapPlan.from_dict({"bucket_kb": 64}, source="file").collectives is None  # the job's own


def test_partition_naming_cores_the_machine_lacks_says_which():
    missing = max(available_cores()) + 7
    with pytest.raises(PlanError, match=rf"core\(s\) \[{missing}\] this machine does not give"):
        Partition.from_json({"compute_cores": [0], "comm_cores": [missing]})


def test_plan_file_round_trip_and_bad_files(tmp_path):
    plan = OverlapPlan(bucket_kb=512, partition=Partition(name="pinned"), collectives="chain", source="tuned")
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(plan_file_text(plan, {"world_size": 4})))
    back = OverlapPlan.from_dict(read_plan_file(p)["plan"], source="cache")
    assert (back.bucket_kb, back.partition, back.during_backward, back.collectives) == \
        (512, Partition(name="pinned"), True, "chain")
    assert read_plan_file(tmp_path / "none.json") is None
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(PlanError, match="not readable JSON"):
        read_plan_file(tmp_path / "junk.json")
    (tmp_path / "other.json").write_text(json.dumps({"plan": {}}))
    with pytest.raises(PlanError, match="not an unbroken overlap plan"):
        read_plan_file(tmp_path / "other.json")
    cfg = RunConfig(overlap=str(p))
    assert checked_overlap(cfg)[0].overlap == str(p.resolve())
    (tmp_path / "zero.json").write_text(json.dumps({"format": FORMAT, "plan": {"bucket_kb": 0}}))
    with pytest.raises(PlanError, match="bucket_kb"):
        checked_overlap(RunConfig(overlap=str(tmp_path / "zero.json")))


def test_partitions_map_local_ranks_to_cores():
    have = available_cores()
    assert Partition(name="shared").cores(0) == (None, None)
    compute, comm = Partition(name="pinned").cores(1)
    assert compute == {have[1 % len(have)]} and comm == set(have)
    compute, comm = Partition(name="split").cores(0)
    assert compute == {have[0]} and (comm == set(have) - {have[0]} or len(have) == 1)


@linux_affinity
def test_pinner_puts_the_training_thread_and_the_others_on_their_cores():
    have = available_cores()
    comm_cores = have[1:] or have
    stop = threading.Event()
    comm = threading.Thread(target=stop.wait, args=(10,), name="unbroken-wait-gen0", daemon=True)
    control = threading.Thread(target=stop.wait, args=(10,), name="unbroken-heartbeat", daemon=True)
    pinner = ThreadPinner(Partition.from_json({"compute_cores": [have[0]], "comm_cores": comm_cores}), 0)
    try:
        os.sched_setaffinity(0, {have[0]})  # threads started now inherit the training thread's cores
        comm.start()
        control.start()
        assert pinner.refresh() >= 3 and pinner.refresh() == 0  # the second finds nothing new
        assert os.sched_getaffinity(threading.get_native_id()) == {have[0]}
        assert os.sched_getaffinity(comm.native_id) == set(comm_cores)
        assert os.sched_getaffinity(control.native_id) == set(have)  # control traffic: every core
    finally:
        pinner.release()
        stop.set()
        comm.join(5)
        control.join(5)
    assert os.sched_getaffinity(threading.get_native_id()) == set(have)


def _named():
    m = torch.nn.Linear(4, 3)
    return list(m.named_parameters())


def test_the_cache_key_and_a_stale_cache_retunes_saying_why(tmp_path):
    cfg = RunConfig(world_size=4, overlap=str(tmp_path / "plan.json"), model=ModelConfig())
    key = tuning_key(cfg, _named(), nnodes=1)
    plan = OverlapPlan(bucket_kb=256)
    (tmp_path / "plan.json").write_text(json.dumps(plan_file_text(plan, key)))
    ctl = OverlapControl(cfg, named=_named(), nnodes=1, local_rank=0, emit=lambda *a, **k: None)
    assert not ctl.needs_tuning and ctl.plan.source == "cache" and ctl.plan.bucket_kb == 256
    other = OverlapControl(cfg.replace(world_size=2, parity_group=2), named=_named(), nnodes=1, local_rank=0,
                           emit=lambda *a, **k: None)
    assert other.needs_tuning and "world_size 4 (this job: 2)" in other.why
    assert other.plan.bucket_kb == cfg.bucket_kb  # until the search has chosen


def test_auto_uses_the_cache_dir_and_treats_a_corrupt_cache_as_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("UNBROKEN_CACHE_DIR", str(tmp_path))
    assert cache_path("auto") == tmp_path / "overlap.json" and cache_path("off") is None
    (tmp_path / "overlap.json").write_text("not json")
    ctl = OverlapControl(RunConfig(overlap="auto"), named=_named(), nnodes=1, local_rank=0, emit=lambda *a, **k: None)
    assert ctl.needs_tuning and "not readable JSON" in ctl.why


def test_on_and_off_need_no_tuning_and_take_the_configured_bucket():
    for mode in ("on", "off"):
        ctl = OverlapControl(RunConfig(overlap=mode, bucket_kb=64), named=_named(), nnodes=1, local_rank=0,
                             emit=lambda *a, **k: None)
        assert not ctl.needs_tuning and ctl.plan.bucket_kb == 64 and ctl.plan.during_backward == (mode == "on")


class _Store:
    def __init__(self):
        self.kv = {}

    def set(self, k, v):
        self.kv[k] = v.encode() if isinstance(v, str) else v

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def get(self, k):
        return self.kv[k]


class _Comm:
    def __init__(self, others):
        self.others = others

    def allgather_json(self, obj, what=""):
        return [obj, *self.others]


class _Trainer:
    def __init__(self, others):
        self.comm = _Comm(others)
        self.ctx = types.SimpleNamespace(store=_Store())


def test_a_joining_member_takes_the_agreed_plan_from_the_store(tmp_path):
    store = _Store()
    ctl = OverlapControl(RunConfig(overlap=str(tmp_path / "plan.json")), named=_named(), nnodes=1, local_rank=0,
                         emit=lambda *a, **k: None)
    ctl.adopt_agreed(store)
    assert ctl.needs_tuning  # nothing agreed yet: it searches with its peers
    membership.put(store, STORE_KEY, OverlapPlan(bucket_kb=128).to_dict())
    ctl.adopt_agreed(store)
    assert not ctl.needs_tuning and ctl.plan.bucket_kb == 128 and ctl.plan.source == "agreed"


def test_ranks_search_together_when_any_lacks_the_plan_or_they_differ(tmp_path):
    cfg = RunConfig(world_size=2, parity_group=2, overlap=str(tmp_path / "plan.json"))
    key = tuning_key(cfg, _named(), nnodes=1)
    (tmp_path / "plan.json").write_text(json.dumps(plan_file_text(OverlapPlan(bucket_kb=256), key)))
    plan = {k: v for k, v in OverlapPlan(bucket_kb=256).to_dict().items() if k != "source"}
    assert plan["first_bucket_kb"] == 1024 and plan["eager_update"] is False  # the defaults
    same = {"tune": False, "plan": plan}
    for other, tunes, why in ((same, False, ""), ({**same, "tune": True}, True, "another rank"),
                              ({**same, "plan": {**same["plan"], "bucket_kb": 512}}, True, "different plans")):
        ctl = OverlapControl(cfg, named=_named(), nnodes=1, local_rank=0, emit=lambda *a, **k: None)
        tr = _Trainer([other])
        ctl._agree(tr)
        assert ctl.needs_tuning == tunes and why in ctl.why
        # agreed without a search: the plan is in the store for a shadow joining later (adopt_agreed)
        agreed = membership.get(tr.ctx.store, STORE_KEY)
        assert (agreed is None) == tunes and (tunes or agreed["bucket_kb"] == 256)


def test_a_lead_needs_nearly_every_pair_and_a_real_median_lead():
    gloo = [0.16, 0.17, 0.16, 0.30, 0.16]  # one slow probe: a range rule would call it noise
    assert leads(gloo, [0.12, 0.12, 0.13, 0.12, 0.12])
    assert not leads(gloo, [0.12, 0.18, 0.18, 0.12, 0.12])  # slower in two pairs
    assert not leads([0.16] * 5, [0.155] * 5)  # 3 % faster: within what a plan change costs


@given(own=st.lists(st.floats(0.01, 10.0), min_size=3, max_size=9), scale=st.floats(0.5, 2.0))
def test_a_lead_is_consistent_with_scaling_and_never_picks_a_slower_candidate(own, scale):
    assert not leads(own, [x * 1.01 for x in own])  # slower in every pair
    assert leads(own, [x * 0.5 for x in own]) == leads([x * scale for x in own],
                                                                   [x * 0.5 * scale for x in own])


def test_the_fastest_row_and_the_default_on_a_tie():
    from unbroken.runtime.overlap_tune import _fastest

    rows = [{"step_s": 0.30}, {"step_s": 0.25}, {"step_s": 0.25}, {"step_s": 0.40}]
    assert _fastest(rows) is rows[1]
    assert _fastest([rows[0], {"step_s": 0.30}]) is rows[0]
