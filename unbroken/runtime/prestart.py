"""The fork server started at `unbroken run`'s first line, so that it imports torch while the CLI does.

`python -m unbroken.cli run ...` spends its first seconds importing torch (the CLI's commands
need it); the supervisor then started its fork server (runtime/zygote.py), which imported torch
again, and only then joined the job: two imports in series on every job start. `early(argv)`,
called before the CLI's imports, starts the server at once; the supervisor takes it with
`take(base_env)` if it was started for the same run directory (what a forked child's
/proc/PID/environ shows), else closes it and starts its own. Nothing is written anywhere: a run
refused after this leaves no trace (an exit hook closes an untaken server and waits for it;
PR_SET_PDEATHSIG covers a parent that dies without running it).

Only `run` with an explicit `--run-dir` or `--resume` starts one (the default run directory is
chosen later), and never with UNBROKEN_FORK_SERVER=0.
"""
from __future__ import annotations

import atexit
import os
from pathlib import Path

from unbroken.runtime.zygote import ForkServer

SECRETS = ("UNBROKEN_TOKEN",)  # the supervisor's secrets: never in a child's (or the server's) environment
FORK_SERVER_ENV = "UNBROKEN_FORK_SERVER"  # "0": start every child the exec way
RUN_DIR_ENV = "UNBROKEN_RUN_DIR"

_early: ForkServer | None = None


def inherited() -> dict[str, str]:
    """This process's environment less its secrets: what children (and the server) inherit."""
    return {k: v for k, v in os.environ.items() if k not in SECRETS}


def run_dir_in(argv: list[str]) -> str | None:
    """The run directory a `run` command line names (`--resume` wins, as in the command), resolved."""
    if len(argv) < 2 or argv[1] != "run":
        return None
    found: dict[str, str] = {}
    for i, arg in enumerate(argv[2:], start=2):
        for flag in ("--run-dir", "--resume"):
            if arg == flag and i + 1 < len(argv):
                found[flag] = argv[i + 1]
            elif arg.startswith(flag + "="):
                found[flag] = arg.split("=", 1)[1]
    chosen = found.get("--resume") or found.get("--run-dir")
    return str(Path(chosen).resolve()) if chosen else None


def early(argv: list[str]) -> None:
    """Start the fork server now if `argv` is a `run` with its run directory named."""
    global _early
    if os.environ.get(FORK_SERVER_ENV, "1") == "0" or _early is not None:
        return
    if (run_dir := run_dir_in(argv)) is not None:
        try:
            _early = ForkServer({**inherited(), RUN_DIR_ENV: run_dir})
        except OSError:
            _early = None  # the supervisor starts its own (and says why if that fails too)
        else:  # a run refused before the supervisor took it: reap it before we exit, not after
            atexit.register(discard)


def discard() -> None:
    """Close the early server if nobody took it (waits for it: no process outlives the refusal)."""
    global _early
    server, _early = _early, None
    if server is not None:
        server.close()


def take(base_env: dict[str, str]) -> ForkServer | None:
    """The early server if it was started with `base_env`'s run directory; else None (closed)."""
    global _early
    if _early is not None and _early.env.get(RUN_DIR_ENV) != base_env.get(RUN_DIR_ENV):
        discard()
    server, _early = _early, None
    return server
