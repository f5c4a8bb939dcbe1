"""Failures the runtime must survive or stop on cleanly (issue 12): persistent NaN, a
deterministic bug in the user's script, the loss of a whole node."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import reap, start_leader
from .conftest import SMALL, _procs_of, events, run_cli, run_job, start_node, wait_for_step

pytestmark = pytest.mark.timeout(300)
BAD = str(Path(__file__).parent / "scripts" / "bad_step.py")
BASE = ["--world-size", "4", "--chunk-kb", "16", "--checkpoint-every", "2"]


def _kinds(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in events(run_dir) if e["kind"] == kind]


def test_a_gradient_that_stays_nan_stops_the_job_naming_step_and_tensor(tmp_path):
    p = run_cli(tmp_path / "r", *BASE, BAD, "--bug", "nan", timeout=180)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "step 3" in p.stderr and "first non-finite tensor" in p.stderr and "--on-nonfinite skip" in p.stderr
    numerics = _kinds(tmp_path / "r", "numerics")
    assert 0 < len(numerics) <= 4 * 2  # bounded: nonfinite_retries (2) redos per rank, not forever
    [stop] = _kinds(tmp_path / "r", "nonfinite")
    assert stop["fields"]["action"] == "stop" and stop["fields"]["step"] == 3


def test_skipping_a_nan_step_is_deterministic_across_a_kill(tmp_path):
    skip = ["--on-nonfinite", "skip", "--steps", "8"]
    clean = run_job(tmp_path / "a", *BASE, *skip, BAD, "--bug", "nan")
    killed = run_job(tmp_path / "b", *BASE, *skip, "--inject", "sigkill:rank=2,step=5,phase=optimizer",
                     BAD, "--bug", "nan")
    assert clean["ok"] and killed["ok"]
    assert killed["weights_sha256"] == clean["weights_sha256"]
    [ev] = _kinds(tmp_path / "a", "nonfinite")
    assert ev["fields"]["action"] == "skip" and ev["fields"]["step"] == 3


def test_the_same_exception_twice_is_a_software_fault_with_its_traceback(tmp_path):
    p = run_cli(tmp_path / "r", *BASE, BAD, "--bug", "keyerror", timeout=180)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "KeyError" in p.stderr and "Traceback" in p.stderr and "bad_step.py" in p.stderr
    [sf] = _kinds(tmp_path / "r", "software_fault")
    assert sf["fields"]["occurrences"] == 2 and sf["fields"]["step"] == 3
    crashed = [e for e in _kinds(tmp_path / "r", "process_exited") if e["fields"]["returncode"] == 1]
    assert len(crashed) == 2  # the first occurrence was retried once, the second was not


def _timeline(run_dir: Path) -> str:
    """What decided the run's generations, one line per event: for a failing assertion's message."""
    kinds = {"fault_detected", "fault_classified", "generation", "retry", "collective_error", "node_lost",
             "process_exited", "process_killed", "shadow_assigned", "recovered", "tier2_restore", "warning"}
    t0 = None
    lines = []
    for e in events(run_dir):
        t0 = e["time"] if t0 is None else t0
        if e["kind"] in kinds:
            lines.append(f"{e['time'] - t0:7.3f} node={e.get('node')} rank={e.get('rank')} gen={e.get('gen')} "
                         f"{e['kind']} {json.dumps(e.get('fields'))[:240]}")
    return "\n".join(lines)


NODE_LOSS = [*SMALL, "--parity-group", "2", "--checkpoint-every", "2", "--shadows", "2"]
NODE_LOSS[NODE_LOSS.index("--steps") + 1] = "14"


@pytest.fixture(scope="module")
def node_loss_reference(tmp_path_factory) -> dict:
    """The failure-free run of the node-loss tests' job (on one node: the weights do not depend on it)."""
    return run_job(tmp_path_factory.mktemp("node-loss-ref") / "r", *NODE_LOSS)


def _two_nodes(run_dir: Path, *extra: str, kill_after_step: int | None = None, how: str = "sigkill") -> str:
    """Run NODE_LOSS on two nodes (node 1 started a second after node 0); with `kill_after_step`,
    SIGKILL or SIGSTOP node 1's whole process group once that step is logged. Node 0's stdout."""
    node0, port = start_leader(lambda p: start_node(run_dir, 0, *NODE_LOSS, *extra, "--port", str(p)), group=True)
    node1 = None
    try:
        time.sleep(1.0)
        node1 = start_node(run_dir, 1, *NODE_LOSS, *extra, "--port", str(port))
        if kill_after_step is not None:
            wait_for_step(run_dir, kill_after_step, 120, process=node0)
            os.killpg(node1.pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
        out, err = node0.communicate(timeout=180)
        assert node0.returncode == 0, err[-3000:]
    finally:
        reap([node0, node1], group=True)
        for pid in _procs_of(run_dir.resolve()):
            os.kill(pid, signal.SIGKILL)
    return out


def _assert_one_node_loss(run_dir: Path, summary: dict, reference: dict, report_dir: Path) -> int:
    """Node 1 lost as one incident, its ranks replaced on node 0, the failure-free weights.

    The node-loss generation comes first (no link regroup took the dead node for a broken link)
    and replaces ranks 2 and 3 at once. A collective that fails during its recovery while every
    member lives is regrouped as a link (supervisor._check_link, designed for a link breaking
    during a recovery): same members, nobody replaced. Anything else fails. Returns the number
    of such link regroups."""
    seen = _timeline(run_dir)
    assert summary["ok"] and summary["ranks_agree"], seen
    gens = [e["fields"] for e in _kinds(run_dir, "generation") if e["fields"]["gen"] > 0]
    assert gens and gens[0]["replaced"] == [2, 3] and "node_lost" in gens[0]["cause"], seen
    for before, after in zip(gens, gens[1:]):
        assert after["cause"] == "link" and after["replaced"] == [] and after["members"] == before["members"], seen
    links = ["stall"] * (len(gens) - 1)
    # parity groups are strided across nodes ({0,2}, {1,3}): the node's loss costs each group one
    # member, so both shards are decoded from tier 1 in place (in the last generation) and no step is lost
    recs = summary["recoveries"]
    assert [r["fault"] for r in recs] == ["node_lost", *links], (recs, seen)
    assert recs[-1]["complete"] and recs[-1]["path"] == "tier1" and summary["steps_lost"] == 0, (recs, seen)
    [lost] = _kinds(run_dir, "node_lost")
    assert lost["fields"]["node"] == 1 and lost["fields"]["ranks"] == [2, 3]
    # node 1's supervisor may see its processes die in the instant before it dies with them (their
    # sockets close first) and log it: true, and never acted on (the leader holds another node's
    # reports until its lease decides: runtime/lease.py, FaultHold). The leader decides; node 0 logs it.
    last_words = [e for e in _kinds(run_dir, "fault_detected") if e["node"] == 1]
    assert {e["fields"]["fault"] for e in last_words} <= {"crash"}, seen
    detected = [e for e in _kinds(run_dir, "fault_detected")
                if e["fields"]["fault"] != "collective_error" and e["node"] != 1]
    assert [e["fields"]["fault"] for e in detected] == ["node_lost", *links], seen
    last = gens[-1]["members"]
    assert last["2"].startswith("n0-") and last["3"].startswith("n0-")
    rep = subprocess.run([sys.executable, "-m", "unbroken.cli", "report", str(run_dir), "--json", "--out",
                          str(report_dir)], capture_output=True, text=True, timeout=60)
    faults = [f for f in json.loads(rep.stdout)["faults"] if not (f["class"] == "crash" and f["node"] == 1)]
    # the report: one node-loss incident (and a regroup per failed recovery collective, if any)
    assert [(f["class"], f["node"]) for f in faults[:1]] == [("node_lost", 1)], seen
    assert [f["class"] for f in faults[1:]] == links, seen
    assert summary["weights_sha256"] == reference["weights_sha256"]
    return len(links)


@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_a_whole_node_lost_is_one_incident_and_its_ranks_are_replaced(tmp_path, how, node_loss_reference):
    """Node 1's supervisor and children killed (or frozen) at once: its lease expires, node 0
    replaces both ranks and finishes with the failure-free weights."""
    out = _two_nodes(tmp_path / "r", kill_after_step=4, how=how)
    _assert_one_node_loss(tmp_path / "r", json.loads(out), node_loss_reference, tmp_path / "rep")


def test_a_node_lost_and_a_link_broken_in_its_recovery_regroup_once_more(tmp_path, node_loss_reference):
    """`nodekill` from rank 2 (node 1's supervisor SIGKILLed, its fork server and every process
    there dying with it), then rank 0's links cut while it recovers: the node loss's generation,
    then one link regroup of the same members, then tier 1 and the failure-free weights."""
    out = _two_nodes(tmp_path / "r", "--inject", "nodekill:rank=2,step=5,phase=optimizer",
                     "--inject", "linkdrop:rank=0,step=5,phase=recovery")
    assert _assert_one_node_loss(tmp_path / "r", json.loads(out), node_loss_reference, tmp_path / "rep") == 1
    assert not [e for e in _kinds(tmp_path / "r", "fault_detected") if e["fields"]["fault"] == "crash"]


def test_back_to_back_failures_grow_an_auto_pool_and_cold_takeovers_are_named(tmp_path, reference):
    kills = [f"sigkill:rank={r},step={s},phase=optimizer" for r, s in ((1, 3), (2, 4), (3, 5))]
    args = [*SMALL, "--checkpoint-every", "2", "--shadows", "auto"]
    for k in kills:
        args += ["--inject", k]
    got = run_job(tmp_path / "r", *args)
    assert got["ok"] and got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    sizes = [e["fields"]["size"] for e in _kinds(tmp_path / "r", "shadow_pool")]
    assert sizes and max(sizes) > 1  # failures ~0.5 s apart outpace a shadow's warm-up
    takeovers = [e["fields"]["shadow"] for e in _kinds(tmp_path / "r", "shadow_assigned")]
    assert len(takeovers) == 3 and set(takeovers) <= {"warm", "cold"}
    assert "cold" in takeovers  # the pool of one was drained before it grew


@pytest.mark.slow  # ~90 s on CI's 2 cores; tier-2 restores stay in the default suite (test_recovery's tier2 cases)
def test_every_rank_lost_at_once_restores_tier2_or_stops_saying_why(tmp_path, reference):
    kill_all = [x for r in range(4) for x in ("--inject", f"sigkill:rank={r},step=5,phase=optimizer")]
    got = run_job(tmp_path / "a", *SMALL, "--checkpoint-every", "2", "--shadows", "2", *kill_all)
    assert got["ok"] and got["weights_sha256"] == reference["zero1"]["weights_sha256"]
    saved: dict[int, set] = {}
    for e in _kinds(tmp_path / "a", "checkpoint_saved"):
        if e["gen"] == 0:  # written before the kill (the redo writes its own later)
            saved.setdefault(e["fields"]["step"], set()).add(e["rank"])
    # SIGKILLed at step 5: step 4's checkpoint landed on every rank unless a write was still in flight.
    # A file can land (renamed into place) and the kill come before its event is written, so the
    # events give a lower bound: the restore takes that step or a newer, checksum-verified one.
    newest_logged = max(s for s, ranks in saved.items() if s <= 4 and len(ranks) == 4)
    restored = [e["fields"]["step"] for e in _kinds(tmp_path / "a", "tier2_restore")]
    assert len(set(restored)) == 1, restored  # every rank restored the same step
    assert newest_logged <= restored[0] <= 4 and got["steps_lost"] == 4 - restored[0]  # step 5 never committed
    p = run_cli(tmp_path / "b", *SMALL, "--checkpoint-every", "0", "--shadows", "2", *kill_all, timeout=180)
    assert p.returncode == 1 and "cannot be restored" in p.stderr and "checkpoint" in p.stderr, p.stderr[-2000:]
