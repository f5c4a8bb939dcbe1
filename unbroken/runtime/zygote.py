"""The fork server: one process per supervisor pays for `import torch` once, and every worker
and shadow of that supervisor is forked from it, ready to run the job's script.

Why: a process started as `python -m unbroken.runtime.launch` spends 1.5-2 s of CPU importing
torch before it runs a line of the job. A supervisor starts world + shadows of them, and a new
shadow after every takeover, on the cores its workers train on. Forked from a process that has
imported torch and done nothing else (no thread, no process group, no CUDA context), a child
is ready in milliseconds.

Protocol, JSON lines on the server's stdin and stdout:
    supervisor -> server  {"proc", "argv", "env", "log", "cwd"}     one per child
    server -> supervisor  {"ready": pid}                             once, when torch is imported
                          {"started": proc, "pid": N}                 per request
                          {"exited": N, "code": C}                    when the server reaped N
C reads as subprocess.Popen's returncode (-signal when killed). The server reaps every child it
forks. Its stdin closing (the supervisor is done, or dead) makes it SIGKILL what is left, reap
it and exit. It ignores SIGINT: a Ctrl-C reaches the supervisor, which stops the children.

A forked child gets the request's environment (os.environ replaced, so C getenv sees it too),
working directory and log (stdout and stderr; stdin from /dev/null), PR_SET_PDEATHSIG=SIGKILL
against the server (which has the same against its supervisor), SIGINT's default handler back,
and then runs runtime/launch.py's main, as the exec path does. /proc/PID/environ keeps showing
the server's start environment: the supervisor's base environment without its secrets.

The server imports only torch, torch.nn, torch.distributed and numpy before forking: none of
them reads the job's environment at import. unbroken's runtime modules load in each child.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

POLL_S = 0.01  # how often the server reaps exited children when no request comes (the supervisor polls as often)
READY_TIMEOUT_S = 120.0  # importing torch on a loaded machine
START_TIMEOUT_S = 30.0  # a fork answered


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG=SIGKILL: this process dies when the one that started it does."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def _write(msg: dict) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def _become(req: dict, server: int) -> None:
    """In the forked child: turn into the requested worker, run it, never return."""
    try:
        die_with_parent()
        if os.getppid() != server:  # the server died between the fork and the prctl
            os._exit(1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        from unbroken.runtime import launch

        sys.argv = [launch.__file__, *req["argv"]]
        launch.main()  # ends the process itself (os._exit)
    except BaseException:  # noqa: BLE001 - the child must never return into the server's loop
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)


def _reap(live: set[int]) -> None:
    while live:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        live.discard(pid)
        _write({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _end(live: set[int]) -> None:
    for pid in live:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in list(live):
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def serve() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch  # noqa: F401 - the point of the server: imported once, shared by every fork
    import torch.distributed  # noqa: F401
    import torch.nn  # noqa: F401
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    me, live, buf = os.getpid(), set(), b""
    _write({"ready": me})
    while True:
        readable, _, _ = select.select([0], [], [], POLL_S)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become(req, me)
                live.add(pid)
                _write({"started": req["proc"], "pid": pid})
        _reap(live)
    _end(live)


class ForkServerDown(RuntimeError):
    """The server could not start, or stopped answering: start children the exec way."""


class Forked:
    """A child of the fork server, seen from the supervisor: the slice of subprocess.Popen that
    runtime/procs.py uses (pid, poll, wait, returncode)."""

    def __init__(self, pid: int, server: "ForkServer") -> None:
        self.pid, self._server, self.returncode = pid, server, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._server.wait_exit(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
            self.returncode = code
        return self.returncode


class ForkServer:
    """The supervisor's end: starts the server (it imports torch while the supervisor goes on),
    asks it for children, and learns their exits from a reader thread."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)  # its start environment: every forked child's /proc/PID/environ
        self._err = tempfile.TemporaryFile()  # the server's own stderr: quoted if it fails (no file in RUN_DIR yet)
        self._popen = subprocess.Popen([sys.executable, "-m", "unbroken.runtime.zygote"], env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                       preexec_fn=die_with_parent)
        self._cond = threading.Condition()
        self._ready, self._down = False, False
        self._started: dict[str, int] = {}
        self._codes: dict[int, int] = {}
        threading.Thread(target=self._read, name="fork-server-reader", daemon=True).start()

    def _read(self) -> None:
        for line in self._popen.stdout:
            msg = json.loads(line)
            with self._cond:
                if "ready" in msg:
                    self._ready = True
                elif "started" in msg:
                    self._started[msg["started"]] = msg["pid"]
                elif "exited" in msg:
                    self._codes[msg["exited"]] = msg["code"]
                self._cond.notify_all()
        with self._cond:  # the server is gone: its children died with it (PR_SET_PDEATHSIG)
            self._down = True
            self._cond.notify_all()

    def _wait_for(self, what, timeout_s: float, doing: str):
        with self._cond:
            if not self._cond.wait_for(lambda: self._down or what(), timeout=timeout_s):
                raise ForkServerDown(f"fork server did not answer {doing} within {timeout_s:.0f}s")
            if not what():
                raise ForkServerDown(f"fork server exited (rc {self._popen.poll()}) {doing}: {self._last_error()}")
            return what()

    def _last_error(self) -> str:
        self._err.seek(0)
        lines = self._err.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    def wait_ready(self) -> None:
        """Block until the server has imported torch (call it before anything that must not stall)."""
        self._wait_for(lambda: self._ready, READY_TIMEOUT_S, "while importing torch")

    def start(self, proc: str, argv: list[str], env: dict[str, str], log: Path) -> Forked:
        self.wait_ready()
        req = {"proc": proc, "argv": argv, "env": env, "log": str(log), "cwd": os.getcwd()}
        with self._cond:
            self._started.pop(proc, None)
        try:
            self._popen.stdin.write((json.dumps(req) + "\n").encode())
            self._popen.stdin.flush()
        except (BrokenPipeError, ValueError) as e:
            raise ForkServerDown(f"fork server gone: {e}") from None
        pid = self._wait_for(lambda: self._started.get(proc), START_TIMEOUT_S, f"starting {proc}")
        return Forked(pid, self)

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._codes:
                return self._codes[pid]
            return -signal.SIGKILL if self._down else None

    def wait_exit(self, pid: int, timeout_s: float | None) -> int | None:
        """`pid`'s exit code once the server reports it (None if `timeout_s` passes first)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._codes or self._down, timeout=timeout_s)
        return self.exit_code(pid)

    def close(self, timeout_s: float = 5.0) -> None:
        """Close its stdin (it kills and reaps what is left) and reap it."""
        try:
            self._popen.stdin.close()
        except OSError:
            pass
        try:
            self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait(timeout=timeout_s)
        self._err.close()


if __name__ == "__main__":
    serve()
