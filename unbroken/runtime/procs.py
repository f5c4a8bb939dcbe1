"""Processes a supervisor owns: start them, watch them, kill them, reap them.

Children get PR_SET_PDEATHSIG=SIGKILL so that they die with their supervisor even if
it is SIGKILLed; their output goes to RUN_DIR/logs/PROC.log. The join token is not
in their environment (they never need it).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


_SECRETS = ("UNBROKEN_TOKEN",)  # the supervisor's secrets: never in a worker's environment


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    proc: str
    role: str  # worker | shadow
    popen: subprocess.Popen
    started: float = field(default_factory=time.time)
    rank: int | None = None
    taken: bool = False  # a shadow given a rank
    reaped: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()


class ProcessTable:
    def __init__(self, run_dir: Path, base_env: dict[str, str], script: list[str]) -> None:
        self.run_dir, self.base_env, self.script = run_dir, base_env, script
        self.children: dict[str, Child] = {}
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, proc: str, role: str, env: dict[str, str]) -> Child:
        log = open(self.run_dir / "logs" / f"{proc}.log", "ab")
        inherited = {k: v for k, v in os.environ.items() if k not in _SECRETS}
        full_env = {**inherited, **self.base_env, **env, "UNBROKEN_PROC": proc, "UNBROKEN_ROLE": role}
        popen = subprocess.Popen([sys.executable, "-m", "unbroken.runtime.launch", *self.script],
                                 env=full_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 preexec_fn=_die_with_parent)
        log.close()
        child = Child(proc=proc, role=role, popen=popen, rank=int(env["RANK"]) if "RANK" in env else None)
        self.children[proc] = child
        return child

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
