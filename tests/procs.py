"""Child processes a test starts, reaped whatever happens: `communicate_all` waits for each, and
`reap` kills (the whole session when the child leads one) and waits for any still running."""
from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable


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
