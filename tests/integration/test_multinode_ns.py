"""Two nodes, each in its own network namespace on a 1 Gbit/s link, launched the way Slurm
launches them: `unbroken run` with no node flags, its place taken from SLURM_* variables.
Skipped with the reason when namespaces cannot be built (not root, no iproute2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.plan.netns import Netns, Wiring, available

from .conftest import SMALL, _procs_of

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(available() is not None, reason=f"network namespaces: {available()}")]

_LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE")


def _node_cmd(net: Netns, node: int, run_dir: Path) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith(("SLURM_", "PET_"))}
    env.update(net.env(node), SLURM_NNODES="2", SLURM_NODEID=str(node), SLURM_JOB_ID="7001",
               SLURM_JOB_NODELIST=f"10.{net.net}.0.[1-2]", UNBROKEN_TOKEN="ns-token")
    cmd = [*net.exec_prefix(node), sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir),
           "--no-progress", "--json", *SMALL]
    return cmd, env


@pytest.fixture
def two_nodes():
    with Netns(Wiring.uniform("1gbit", 2, 1000), prefix=f"ut{os.getpid() % 10000}") as net:
        yield net


def test_two_slurm_nodes_in_namespaces_train_like_one_node(tmp_path, two_nodes, reference):
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    procs = []
    try:
        for node in (0, 1):
            cmd, env = _node_cmd(two_nodes, node, dirs[node])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    s0, s1 = (json.loads(out) for out, _ in outs)
    assert s0 == s1 and s0["ok"] and s0["ranks_agree"]
    assert s0["weights_sha256"] == reference["zero1"]["weights_sha256"]  # the same job on one node
    evs = [json.loads(x) for x in (dirs[0] / "events.jsonl").read_text().splitlines()]
    [start] = [e for e in evs if e["kind"] == "run_start"]
    assert start["fields"]["nodes"] == 2 and start["fields"]["port"] == 15000 + 7001
    [joined] = [e for e in evs if e["kind"] == "node_joined"]
    assert joined["fields"]["node"] == 1
    assert _procs_of(dirs[0].resolve()) == [] and _procs_of(dirs[1].resolve()) == []
