"""Processes a supervisor owns: start them, watch them, kill them, reap them.

Children are forked from the supervisor's fork server (runtime/zygote.py), which has torch
imported already; when it is off (UNBROKEN_FORK_SERVER=0) or fails, they are started the exec
way, `python -m unbroken.runtime.launch`, each importing torch itself. Either way a child gets
PR_SET_PDEATHSIG=SIGKILL so that it dies with its parent (the supervisor, or the server that
dies with the supervisor) even if that is SIGKILLed; its output goes to RUN_DIR/logs/PROC.log.
The join token is not in its environment (it never needs it).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from unbroken.runtime import prestart
from unbroken.runtime.prestart import FORK_SERVER_ENV, inherited as _inherited
from unbroken.runtime.zygote import ForkServer, ForkServerDown, die_with_parent


def kill_pids(pids: list[int]) -> list[int]:
    """SIGKILL each of `pids` that still exists; returns them."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


@dataclass
class Child:
    proc: str
    role: str  # worker | shadow
    popen: Any  # subprocess.Popen, or zygote.Forked (the same pid / poll / wait)
    started: float = field(default_factory=time.time)
    rank: int | None = None
    taken: bool = False  # a shadow given a rank
    reaped: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()


def fork_server(base_env: dict[str, str], warn: Callable[[str], None]) -> ForkServer | None:
    """A fork server that has imported torch, or None: off (UNBROKEN_FORK_SERVER=0), or it
    failed (`warn` says why). Start it before joining a job: waiting for its import must not
    stall a lease. It writes nothing in the run directory (a refused start leaves none behind).
    `base_env` becomes every child's /proc/PID/environ (runtime/zygote.py)."""
    if os.environ.get(FORK_SERVER_ENV, "1") == "0":
        return None
    server = prestart.take(base_env) or ForkServer({**_inherited(), **base_env})
    try:
        server.wait_ready()
    except ForkServerDown as e:
        warn(f"{e}; starting children the exec way")
        server.close()
        return None
    return server


class ProcessTable:
    def __init__(self, run_dir: Path, base_env: dict[str, str], script: list[str], *,
                 server: ForkServer | None = None, warn: Callable[[str], None] = lambda message: None) -> None:
        self.run_dir, self.base_env, self.script, self.warn = run_dir, base_env, script, warn
        self.children: dict[str, Child] = {}
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.server = server  # None: every child the exec way

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        return {**_inherited(), **self.base_env, **extra}

    def start(self, proc: str, role: str, env: dict[str, str]) -> Child:
        full_env = self._env({**env, "UNBROKEN_PROC": proc, "UNBROKEN_ROLE": role})
        log_path = self.run_dir / "logs" / f"{proc}.log"
        popen = None
        if self.server is not None:
            try:
                popen = self.server.start(proc, self.script, full_env, log_path)
            except ForkServerDown as e:
                self.warn(f"{e}; starting children the exec way from now on")
                self._close_server()
        if popen is None:
            with open(log_path, "ab") as log:
                popen = subprocess.Popen([sys.executable, "-m", "unbroken.runtime.launch", *self.script],
                                         env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        child = Child(proc=proc, role=role, popen=popen, rank=int(env["RANK"]) if "RANK" in env else None)
        self.children[proc] = child
        return child

    def _close_server(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def kill(self, child: Child) -> None:
        if child.poll() is None:
            try:
                os.kill(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            child.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def stop_all(self, grace_s: float = 2.0) -> None:
        """SIGTERM everyone, then SIGKILL whoever is left after `grace_s`; reap all."""
        live = [c for c in self.children.values() if c.poll() is None]
        for c in live:
            try:
                os.kill(c.pid, signal.SIGCONT)
                os.kill(c.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace_s
        for c in live:
            try:
                c.popen.wait(timeout=max(0.01, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.kill(c)
        for c in self.children.values():
            if c.poll() is None:
                self.kill(c)
        self._close_server()
