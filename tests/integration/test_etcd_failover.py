"""The replicated store (etcd): node 0's whole process group SIGKILLed mid-run, with its etcd member;
node 1 takes the leader role over and the job finishes with the failure-free weights, no step lost.
Skipped with the reason without `etcd` (Debian: etcd-server) or the etcd3gw client."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.procs import reap
from unbroken.runtime import etcd_cluster

from .conftest import SMALL, _procs_of, events, run_job, start_node, wait_for_step

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow,  # ~3 min on 2 cores: `pytest -m slow`
              pytest.mark.skipif(etcd_cluster.missing_reason() is not None,
                                 reason=f"etcd store: {etcd_cluster.missing_reason()}")]

ARGS = [*SMALL, "--parity-group", "2", "--checkpoint-every", "2", "--shadows", "2"]
# a loaded 2-core host: every store call is an HTTP round trip, and losing an etcd member costs an election
LEASE = 'node_lease_s = 8.0\n'


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(LEASE)
    return path


@pytest.fixture
def cluster(tmp_path):
    with etcd_cluster.running(etcd_cluster.scratch_dir(f"unbroken-etcd-{tmp_path.name}", tmp_path)) as members:
        yield members


def test_node_0_lost_with_its_etcd_member_the_job_goes_on_from_tier_1(tmp_path, cluster, config):
    run_dir, store = tmp_path / "r", etcd_cluster.url(cluster, "failover")
    node0 = start_node(run_dir, 0, "--config", str(config), *ARGS, "--store", store)
    node1 = None
    try:
        time.sleep(1.0)
        node1 = start_node(run_dir, 1, "--config", str(config), *ARGS, "--store", store)
        wait_for_step(run_dir, 3, 150)
        os.killpg(node0.pid, signal.SIGKILL)  # supervisor, workers, shadows of node 0
        etcd_cluster.kill_member(cluster[0])  # and the store member that lived on it
        out, err = node1.communicate(timeout=180)
        assert node1.returncode == 0, err[-3000:]
    finally:
        reap([node0, node1], group=True)
        for pid in _procs_of(run_dir.resolve()):
            os.kill(pid, signal.SIGKILL)
    summary = json.loads(out)
    assert summary["ok"] and summary["ranks_agree"] and summary["steps_lost"] == 0, summary
    [elected] = [e for e in events(run_dir) if e["kind"] == "leader_elected"]
    assert elected["fields"]["node"] == 1 and elected["fields"]["previous"] == 0
    [lost] = [e for e in events(run_dir) if e["kind"] == "node_lost"]
    assert lost["fields"]["node"] == 0 and lost["fields"]["ranks"] == [0, 1]
    [rec] = summary["recoveries"]
    assert rec["path"] == "tier1", rec
    last = [e for e in events(run_dir) if e["kind"] == "generation"][-1]["fields"]["members"]
    assert all(p.startswith("n1-") for p in last.values())  # every rank on node 1 now
    ref = run_job(tmp_path / "ref", "--config", str(config), *ARGS)  # the same job, one node, TCPStore, no failure
    assert summary["weights_sha256"] == ref["weights_sha256"]
