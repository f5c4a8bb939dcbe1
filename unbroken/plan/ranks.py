"""Run one process per rank (on loopback or each in its wiring's namespace), and reap them all.

`run_ranks` starts rank r's argv (inside `netns.exec_prefix(r)` when a wiring is given),
with MASTER = rank 0's address, waits up to `timeout_s` for all of them, and on any failure
or timeout kills every one before raising RanksFailed with the first failing rank's stderr.
`topology()` measures a wiring with `plan.probe`.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from unbroken.plan.netns import Netns
from unbroken.plan.topology import Topology


class RanksFailed(RuntimeError):
    """A rank process exited non-zero or the group ran past its timeout."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def master_of(net: Netns | None) -> str:
    """HOST:PORT for rank 0's store: its namespace address, or loopback."""
    if net is None:
        return f"127.0.0.1:{free_port()}"
    return f"{net.address(0)}:{29500 + os.getpid() % 2000}"  # a fresh namespace has every port free


def run_ranks(argv_of: Callable[[int, str], Sequence[str]], world: int, *, net: Netns | None = None,
              timeout_s: float = 600.0, env: dict[str, str] | None = None, what: str = "ranks") -> None:
    """Run argv_of(rank, master) for every rank; raise RanksFailed unless all exit 0 in time."""
    master = master_of(net)
    logs = [tempfile.TemporaryFile() for _ in range(world)]
    procs: list[subprocess.Popen] = []
    try:
        for r in range(world):
            extra = {**(env or {}), **(net.env(r) if net else {})}
            cmd = (net.exec_prefix(r) if net else []) + list(argv_of(r, master))
            procs.append(subprocess.Popen(cmd, env={**os.environ, **extra}, stdout=logs[r], stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            bad = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if bad or time.monotonic() > deadline:
                r = bad[0] if bad else None
                why = f"rank {r} exited {procs[r].returncode}" if bad else f"ran past {timeout_s:g} s"
                raise RanksFailed(f"{what}: {why}: {_tail(logs[r if bad else 0])}")
            time.sleep(0.05)
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise RanksFailed(f"{what}: rank {bad[0]} exited {procs[bad[0]].returncode}: {_tail(logs[bad[0]])}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for f in logs:
            f.close()


def _tail(f, n: int = 1500) -> str:
    f.seek(0)
    text = f.read().decode(errors="replace").strip()
    return text[-n:] if text else "(no output)"


def topology(world: int, out: Path, *, net: Netns | None = None, max_bytes: int = 64 << 20,
             op_budget_s: float = 2.0, label: str = "", timeout_s: float = 600.0) -> Topology:
    """Measure the wiring (`plan.probe` on every rank) and return what rank 0 wrote to `out`."""
    out = Path(out).resolve()

    def argv(r: int, master: str) -> list[str]:
        return [sys.executable, "-m", "unbroken.plan.probe", "--rank", str(r), "--world", str(world),
                "--master", master, "--out", str(out), "--max-bytes", str(max_bytes),
                "--op-budget-s", str(op_budget_s), "--label", label]

    run_ranks(argv, world, net=net, timeout_s=timeout_s, env={"OMP_NUM_THREADS": "1"}, what="topology probe")
    return Topology.load(out)
