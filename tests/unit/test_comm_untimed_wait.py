"""A wait inside gloo (the caller's, for transfers whose flows are not read; comm/transport.py) still
ends within milliseconds of a newer generation: the watchdog drops the group's links."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.procs import free_port, reap
from unbroken.comm import native_ring

pytestmark = pytest.mark.timeout(90)

TIMEOUT_S, NEWER_AFTER_S = 20.0, 1.0


@pytest.mark.parametrize("walk", ["python", "compiled"])
def test_a_newer_generation_ends_a_wait_inside_gloo_at_once(walk):
    """1 MB runs the even ring, whose walk waits inside gloo in Python or in C++ (native_ring.py)."""
    if walk == "compiled" and (why := native_ring.build()):
        pytest.skip(why)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path),
           "UNBROKEN_NATIVE": "1" if walk == "compiled" else "0"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.unit.stalled_peer", "--rank", str(r), "--port", str(port),
                               "--timeout", str(TIMEOUT_S), "--newer-after", str(NEWER_AFTER_S)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=60)
    finally:
        reap(procs)  # rank 1 stalls until killed
    assert procs[0].returncode == 0, err[-800:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["raised"] == "GenerationChanged", res
    assert res["waited_s"] > NEWER_AFTER_S / 2, res  # it was waiting inside gloo, not refused at once
    assert res["after_newer_s"] < 1.0, res  # the collective's timeout is 20 s: only the watchdog ends it this soon
