"""A rank's uncaught exception, recorded where the leader can judge it.

A crash of the user's code is retried like any other process loss, once. (An exception
of unbroken's own classes, or raised in unbroken's own code — a collective that failed, a
recovery that could not proceed, an internal check — is an infrastructure fault and never
judged this way.) Occurrences are counted per generation: the same exception on several
ranks in one step is one occurrence; the same exception again after a recovery is two. If the same
exception (type, message, raising line) comes back at the same step, it is a bug in the
script, not bad luck: retrying it only burns the budget and hides the traceback. The
process that raised writes `crash/{proc}` (step, error, fingerprint, traceback) to the
store before it exits; the leader (runtime/supervisor.py) counts fingerprints and stops
the job on the second occurrence with that traceback and exit status 1.

A worker may also declare the job unrunnable itself (`declare_fatal`: e.g. gradients
that stay non-finite): `fatal` names the reason and the leader stops the job the same way.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback
from datetime import timedelta
from typing import Any

from unbroken.config import ConfigError

_ctx = None  # the ProcessContext of this process, once unbroken.Trainer has started
_step = None  # () -> the step the process is executing (its last committed step + 1)
_at_clean_exit = []  # run when the script returns normally (Trainer.finish, if the script did not call it)
_at_crash_exit = []  # run when it ends in an exception


def at_clean_exit(fn) -> None:
    _at_clean_exit.append(fn)


def at_crash_exit(fn) -> None:
    """Run `fn` when the script ends in an exception, after the crash is recorded (the
    Trainer lands its checkpoint in flight: the snapshot is of a committed step)."""
    _at_crash_exit.append(fn)


def clean_exit() -> None:
    """Called by the process entry point when the script returned without an exception."""
    while _at_clean_exit:
        _at_clean_exit.pop()()


def register(ctx, step) -> None:
    global _ctx, _step
    _ctx, _step = ctx, step


def fingerprint(exc: BaseException, step: int | None) -> str:
    """Identity of an exception across processes: type, message, raising line, step."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    text = f"{type(exc).__qualname__}|{str(exc)[:500]}|{where}|{step}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../unbroken
_LIBRARIES = tuple({os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})


def raised_by_script(exc: BaseException) -> bool:
    """Is this the script's exception? Not if its class is unbroken's, nor if the innermost
    frame of code that is either unbroken's or the script's (libraries and the standard
    library skipped: torch raising for the script's bad call is the script's) is unbroken's."""
    if type(exc).__module__.startswith("unbroken."):
        return False
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PACKAGE + os.sep):
            return False
        if not path.startswith(_LIBRARIES) and not frame.filename.startswith("<"):
            return True
    return True


def describe(exc: BaseException) -> dict[str, Any]:
    step = _step() if _step is not None else None
    return {"step": step, "gen": _ctx.phase.get("gen") if _ctx is not None else None,
            "phase": _ctx.phase.get("phase") if _ctx is not None else None,
            "error": f"{type(exc).__name__}: {str(exc)[:500]}", "fingerprint": fingerprint(exc, step),
            "traceback": "".join(traceback.format_exception(exc))[-6000:]}


def record(exc: BaseException) -> None:
    """Called by the process entry point with the exception that ends the process."""
    if _ctx is None:
        return  # not (yet) an unbroken process: the exit status alone reports it
    if not raised_by_script(exc):
        return  # the runtime's own verdict or internal check: an infrastructure fault, never the
        # script's bug, however often it repeats
    try:
        _ctx.store.set(f"crash/{_ctx.proc}", json.dumps(describe(exc)))
    except Exception:  # noqa: BLE001 - the store is gone: the job is over anyway
        pass
    while _at_crash_exit:
        try:
            _at_crash_exit.pop()()
        except Exception:  # noqa: BLE001 - best effort on the way out; the exit status reports the crash
            pass


def declare_fatal(ctx, message: str, *, leader: bool, timeout_s: float = 10.0) -> None:
    """Tell the leader this job cannot go on (`leader`: the one rank that writes it); every
    rank waits until the key exists, so that the leader reads the reason before any exit."""
    if leader:
        ctx.store.set("fatal", json.dumps({"message": message, "proc": ctx.proc}))
    try:
        ctx.store.wait(["fatal"], timedelta(seconds=timeout_s))
    except RuntimeError:
        pass  # the declaring rank died: exit anyway, the crash path reports it


class Refused(ConfigError):
    """A user mistake a worker refused (Trainer._refuse): its message is in the store's `abort`
    key and the supervisor prints it as the job's one-line error (exit 2). The process exits
    without printing a traceback: with --tee it would reach the console around that line."""


class SoftwareFault(RuntimeError):
    """The training script itself fails (the same exception again, or a worker declared the job
    unrunnable): retrying cannot help. The message carries the rank's traceback; exit 1."""


class CrashJudge:
    """The leader's side: counts crash fingerprints and reads `fatal`; raises SoftwareFault."""

    def __init__(self, store, events) -> None:
        self.store, self.events = store, events
        self.counts: dict[str, set] = {}  # fingerprint -> generations it occurred in

    def _get(self, key: str) -> dict | None:
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def check_fatal(self) -> None:
        """A worker declared the job unrunnable (declare_fatal): stop."""
        f = self._get("fatal")
        if f is None:
            return
        crash = self._get(f"crash/{f['proc']}") or {}
        self.events.emit("job_stopped", proc=f["proc"], reason=f["message"], step=crash.get("step"))
        raise SoftwareFault(f"{f['message']}\n{crash.get('traceback', '')}".rstrip())

    def judge(self, proc: str) -> None:
        """`proc` was lost: the same exception (type, message, line, step) a second time is the
        script's bug — stop with its traceback instead of replacing the rank again."""
        crash = self._get(f"crash/{proc}")
        if crash is None:
            return
        self.store.delete_key(f"crash/{proc}")
        fp = crash["fingerprint"]
        gens = self.counts.setdefault(fp, set())
        gens.add(crash.get("gen"))
        if len(gens) < 2:
            return
        self.events.emit("software_fault", proc=proc, step=crash["step"], error=crash["error"], fingerprint=fp,
                         occurrences=len(gens))
        raise SoftwareFault(f"{proc} raised the same exception at step {crash['step']} again "
                            f"({crash['error']}): a bug in the training script, not retried\n"
                            f"{crash['traceback']}".rstrip())
