"""Child processes a test starts, reaped whatever happens: `communicate_all` waits for each, and
`reap` kills (the whole session when the child leads one) and waits for any still running."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable

from unbroken.bench.common import free_port  # noqa: F401 - used here and by tests
from unbroken.comm.group import socket_fds


def reap(procs: Iterable[subprocess.Popen | None], *, group: bool = False, timeout: float = 10.0) -> None:
    """Kill what still runs (its process group if `group`: a child started in a session of its
    own) and wait for every process, so no test leaves one behind."""
    for p in procs:
        if p is None:
            continue
        if p.poll() is None:
            if group:
                os.killpg(p.pid, signal.SIGKILL)
            else:
                p.kill()
        p.wait(timeout=timeout)


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple]:
    """Each process's (stdout, stderr) once it ends, in order; all of them reaped on any error."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        reap(procs)


def _listens(pid: int, port: int) -> bool:
    """Does process `pid` hold a socket listening on TCP `port` (Linux /proc: net/tcp state 0A, fd inodes)?"""
    inodes = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return any(link[8:-1] in inodes for link in socket_fds(pid).values())


def start_leader(start, *, attempts: int = 3, timeout: float = 60.0, group: bool = False):
    """(node 0, its port): `start(port)` launches node 0 (a Popen with stderr piped) on a free
    port; wait until it listens there. A port another process took between our choosing and
    node 0's binding ("Address already in use") is retried on a new port."""
    for _ in range(attempts):
        port = free_port()
        node0 = start(port)
        deadline = time.monotonic() + timeout
        while node0.poll() is None and not _listens(node0.pid, port):
            if time.monotonic() > deadline:
                reap([node0], group=group)
                raise AssertionError(f"node 0 did not listen on port {port} within {timeout:.0f}s")
            time.sleep(0.05)
        if node0.poll() is None:
            return node0, port
        err = node0.stderr.read()
        node0.wait()
        if "Address already in use" not in err:
            raise AssertionError(f"node 0 exited ({node0.returncode}) before listening: {err[-2000:]}")
    raise AssertionError(f"every one of {attempts} free ports was taken before node 0 could bind it")
