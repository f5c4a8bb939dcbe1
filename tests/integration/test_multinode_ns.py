"""Two nodes, each in its own network namespace on a 1 Gbit/s link, launched the way Slurm
launches them: `unbroken run` with no node flags, its place taken from SLURM_* variables.
Skipped with the reason when namespaces cannot be built (not root, no iproute2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import reap
from unbroken.plan.netns import Netns, Wiring, available
from unbroken.runtime import etcd_cluster

from .conftest import SMALL, _procs_of

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(available() is not None, reason=f"network namespaces: {available()}")]

_LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE")


def _node_cmd(net: Netns, node: int, run_dir: Path, *extra: str) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith(("SLURM_", "PET_"))}
    env.update(net.env(node), SLURM_NNODES="2", SLURM_NODEID=str(node), SLURM_JOB_ID="7001",
               SLURM_JOB_NODELIST=f"10.{net.net}.0.[1-2]", UNBROKEN_TOKEN="ns-token")
    cmd = [*net.exec_prefix(node), sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir),
           "--no-progress", "--json", *SMALL, *extra]
    return cmd, env


def _run_two_nodes(net: Netns, dirs: list[Path], during=None) -> tuple[list[int], list[tuple[str, str]]]:
    """Start node 0 and node 1 (Slurm's variables), call `during(node0)`, wait for both; always reaped."""
    procs = []
    try:
        for node in (0, 1):
            cmd, env = _node_cmd(net, node, dirs[node])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        if during is not None:
            during(procs[0])
        outs = [p.communicate(timeout=200) for p in procs]
    finally:
        reap(procs)
    return [p.returncode for p in procs], outs


@pytest.fixture
def two_nodes():
    with Netns(Wiring.uniform("1gbit", 2, 1000), prefix=f"ut{os.getpid() % 10000}") as net:
        yield net


@pytest.mark.slow  # the partition test below launches the same way and also ends equal to the one-node run
def test_two_slurm_nodes_in_namespaces_train_like_one_node(tmp_path, two_nodes, reference):
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    codes, outs = _run_two_nodes(two_nodes, dirs)
    for code, (out, err) in zip(codes, outs):
        assert code == 0, err[-2000:]
    s0, s1 = (json.loads(out) for out, _ in outs)
    assert s0 == s1 and s0["ok"] and s0["ranks_agree"]
    assert s0["weights_sha256"] == reference["zero1"]["weights_sha256"]  # the same job on one node
    evs = [json.loads(x) for x in (dirs[0] / "events.jsonl").read_text().splitlines()]
    [start] = [e for e in evs if e["kind"] == "run_start"]
    assert start["fields"]["nodes"] == 2 and start["fields"]["port"] == 15000 + 7001
    [joined] = [e for e in evs if e["kind"] == "node_joined"]
    assert joined["fields"]["node"] == 1
    assert _procs_of(dirs[0].resolve()) == [] and _procs_of(dirs[1].resolve()) == []


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def _steps_done(run_dir: Path) -> int:
    ev = run_dir / "events.jsonl"
    if not ev.exists():
        return 0
    return sum(1 for line in ev.read_text().splitlines() if '"kind":"step"' in line and '"rank":0,' in line)


def test_a_partitioned_node_fences_itself_and_its_ranks_are_rebuilt_from_tier_1(tmp_path, two_nodes, reference):
    """Two nodes launched by Slurm's variables; node 1's link goes down mid-run: node 0 replaces its
    ranks from tier 1 (parity groups of one rank per node) and finishes bitwise equal to the one-node
    run; node 1 stops its processes (fenced) and writes nothing in its run directory after the fence."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]

    def cut_node_1_after_a_step(node0: subprocess.Popen) -> None:
        deadline = time.monotonic() + 120
        while _steps_done(dirs[0]) < 1 and time.monotonic() < deadline and node0.poll() is None:
            time.sleep(0.02)
        subprocess.run([*two_nodes.exec_prefix(1), "ip", "link", "set", "eth0", "down"], check=True, timeout=10)

    codes, ((out0, err0), (_, err1)) = _run_two_nodes(two_nodes, dirs, during=cut_node_1_after_a_step)
    assert codes[0] == 0, err0[-2000:]
    summary = json.loads(out0)
    assert summary["ok"] and summary["steps"] == 8
    assert summary["weights_sha256"] == reference["zero1"]["weights_sha256"]  # the same job on one node
    [rec] = summary["recoveries"]
    assert rec["path"] == "tier1", rec
    assert [(e["fields"]["nodes"], e["fields"]["port"]) for e in _events(dirs[0]) if e["kind"] == "run_start"] == [
        (2, 15000 + 7001)]  # SLURM_NNODES and the port derived from SLURM_JOB_ID
    evs0 = [json.loads(x) for x in (dirs[0] / "events.jsonl").read_text().splitlines()]
    assert [e["fields"]["node"] for e in evs0 if e["kind"] == "node_lost"] == [1]
    assert codes[1] == 2 and "fenced" in err1 and "Traceback" not in err1, err1[-2000:]
    evs1 = [json.loads(x) for x in (dirs[1] / "events.jsonl").read_text().splitlines()]
    assert evs1[-1]["kind"] == "node_fenced"
    fenced_at = evs1[-1]["time"]
    late = [str(f) for f in dirs[1].rglob("*") if f.is_file() and f.parent.name != "logs"
            and f.stat().st_mtime > fenced_at + 0.05]
    assert late == []  # the console copies in logs/ may still take the killed processes' last lines
    assert _procs_of(dirs[0].resolve()) == [] and _procs_of(dirs[1].resolve()) == []


@pytest.mark.slow  # ~3 min on 2 cores: every store call is an HTTP round trip to a replicated store
@pytest.mark.skipif(etcd_cluster.missing_reason() is not None, reason=f"etcd store: {etcd_cluster.missing_reason()}")
def test_node_0_dies_whole_with_its_store_member_and_node_1_finishes_the_job(tmp_path):
    """Three namespaces: nodes 0 and 1 train (Slurm's variables), each with an etcd member beside it, and a
    third member on a store-only host. Every process in node 0's namespace is SIGKILLed mid-run (its
    supervisor, workers, shadows and etcd member): node 1 takes the leader role, rebuilds node 0's ranks
    from tier 1 and finishes with the one-node run's weights, no step lost."""
    args = ["--parity-group", "2", "--checkpoint-every", "2", "--shadows", "2"]
    config = tmp_path / "job.toml"
    config.write_text("node_lease_s = 8.0\n")  # a loaded 2-core host; losing a member costs an election
    dirs = [tmp_path / "node0", tmp_path / "node1"]  # no shared file system: each node writes its own
    with Netns(Wiring.uniform("1gbit", 3, 1000), prefix=f"ue{os.getpid() % 10000}", host_address=True) as net:
        with etcd_cluster.running(tmp_path / "etcd", hosts=[net.address(i) for i in range(3)],
                                  prefixes=[net.exec_prefix(i) for i in range(3)]) as members:
            store = etcd_cluster.url(members, "ns-failover")
            procs = []
            try:
                for node in (0, 1):
                    cmd, env = _node_cmd(net, node, dirs[node], "--config", str(config), *args, "--store", store)
                    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                  text=True, start_new_session=True))
                deadline = time.monotonic() + 150
                while _steps_done(dirs[0]) < 3 and time.monotonic() < deadline and procs[1].poll() is None:
                    time.sleep(0.05)
                if _steps_done(dirs[0]) < 3:
                    for p in procs:
                        p.kill()
                    pytest.fail("the job did not reach step 3: " + " | ".join(p.communicate(timeout=10)[1][-1500:]
                                                                              for p in procs))
                assert any(pid == members[0].pid for pid in net.kill_all(0))  # node 0 dies whole, etcd too
                out, err = procs[1].communicate(timeout=180)
                assert procs[1].returncode == 0, err[-3000:]
            finally:
                reap(procs, group=True)
    summary = json.loads(out)
    assert summary["ok"] and summary["ranks_agree"] and summary["steps_lost"] == 0, summary
    evs = _events(dirs[1])
    [elected] = [e for e in evs if e["kind"] == "leader_elected"]
    assert elected["fields"]["node"] == 1 and elected["fields"]["previous"] == 0
    assert [e["fields"]["node"] for e in evs if e["kind"] == "node_lost"] == [0]
    [rec] = summary["recoveries"]
    assert rec["path"] == "tier1", rec
    ref = subprocess.run([sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(tmp_path / "ref"),
                          "--no-progress", "--json", *SMALL, "--config", str(config), *args],
                         capture_output=True, text=True, timeout=240)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert summary["weights_sha256"] == json.loads(ref.stdout)["weights_sha256"]  # one node, TCPStore, no failure
    assert _procs_of(dirs[0].resolve()) == [] and _procs_of(dirs[1].resolve()) == []
