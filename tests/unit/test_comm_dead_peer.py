"""A peer that dies mid-collective: survivors raise CollectiveError within the timeout, never hang.

A survivor that needed nothing more from the dead peer (a tree aggregator whose rows all
arrived) may finish with the right sum; any other outcome is a failure."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.procs import communicate_all
from unbroken.bench.common import free_port
from unbroken.comm import native_ring

TIMEOUT_S = 6.0


@pytest.mark.parametrize("pattern", ["pipelined", "chain", "shm", "pipelined-untimed", "ring-compiled", "pipelined-squeezed",
                                     pytest.param("ring", marks=pytest.mark.slow),
                                     pytest.param("ring-untimed", marks=pytest.mark.slow),
                                     pytest.param("tree", marks=pytest.mark.slow)])
def test_a_dead_peer_raises_in_every_survivor(pattern):
    pattern, _, untimed = pattern.partition("-")
    if untimed == "compiled" and (why := native_ring.build()):
        pytest.skip(why)
    world, port, victim = 3, free_port(), 2
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    # compiled: the survivors' ring walks in C++; the victim's in Python, where its posts are counted
    procs = [subprocess.Popen([sys.executable, "-m", "tests.unit.comm_peer", "--rank", str(r), "--world", str(world),
                               "--port", str(port), "--timeout", str(TIMEOUT_S), "--pattern", pattern,
                               "--die-after", str(1 if r == victim else 0), *(["--squeeze"] if untimed == "squeezed" else ["--untimed"] if untimed else [])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "UNBROKEN_NATIVE": str(int(untimed == "compiled" and r != victim))})
             for r in range(world)]
    outs = communicate_all(procs, timeout=60)
    assert procs[victim].returncode == 9, outs[victim][1][-500:]
    raised = 0
    for r in range(world):
        if r == victim:
            continue
        assert procs[r].returncode == 0, outs[r][1][-500:]
        res = json.loads(outs[r][0].strip().splitlines()[-1])
        assert res["raised"] or res["correct"], f"rank {r} finished an all-reduce with a wrong sum: {res}"
        assert res["after_s"] < TIMEOUT_S + 1.0, res
        raised += bool(res["raised"])
    assert raised, "no survivor noticed that a peer died mid-collective"
