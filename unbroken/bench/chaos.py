"""`unbroken chaos`: run random fault schedules as real `unbroken run` jobs, judge each
bitwise against a failure-free reference, print a reproduce command for every one that did
not pass and write the JSON record (`bench/results/chaos.json`)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import typer

from unbroken.bench.chaos_schedule import ChaosShape, Schedule, schedules
from unbroken.bench.common import free_port, git_commit, machine
from unbroken.cli_error import fail
from unbroken.fsutil import atomic_write_bytes, atomic_write_json

# The job every schedule runs: the smallest model the runtime is tested with.
MODEL_ARGS = ("--n-layer", "2", "--n-embd", "64", "--batch-size", "4", "--chunk-kb", "16")
CHECKPOINT_EVERY = 2  # tier 2 on every other step: two lethal losses in a group restore from it
# Pinned in a config file so that a record's reproduce commands mean the same job later.
CONFIG = {"heartbeat_s": 0.1, "hang_timeout_s": 5.0, "collective_timeout_s": 60.0,
          "protect_every": 4}  # parity steps 4, 8: replays from the gradient log are exercised
OUTCOMES = ("passed", "divergent", "hung", "failed")
REAP_S = 10.0  # after SIGKILL of a job's process group, how long its processes may take to go


@dataclass(frozen=True, kw_only=True)
class ChaosArgs:
    runs: int
    seed: int
    steps: int = 12
    world_size: int = 4
    parity_group: int = 2
    timeout_s: float = 120.0
    nnodes: int = 1  # > 1: every job is that many supervisors on loopback, and whole nodes are lost

    def __post_init__(self) -> None:
        if self.runs < 1:
            raise ValueError(f"--runs must be >= 1, got {self.runs}")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout-s must be > 0 seconds, got {self.timeout_s}")
        _ = self.shape  # validates steps, world size and parity group

    @property
    def shape(self) -> ChaosShape:
        return ChaosShape(world_size=self.world_size, steps=self.steps, parity_group=self.parity_group,
                          protect_every=CONFIG["protect_every"], checkpoint_every=CHECKPOINT_EVERY, nnodes=self.nnodes)

    def job_args(self, config: Path) -> list[str]:
        """`unbroken run` arguments shared by the reference, every schedule and its reproduce line."""
        return ["--world-size", str(self.world_size), "--steps", str(self.steps), *MODEL_ARGS,
                "--parity-group", str(self.parity_group), "--checkpoint-every", str(CHECKPOINT_EVERY),
                "--config", str(config), *(["--shadows", str(self.nnodes)] if self.nnodes > 1 else [])]


@dataclass
class JobResult:
    rc: int | None  # None: timed out
    summary: dict | None
    wall_s: float
    stderr_tail: str
    fired: list[str]  # specs whose fault_injected event is in the run's events


def config_text() -> str:
    return "".join(f"{k} = {v}\n" for k, v in CONFIG.items())


def node_args(nnodes: int, node: int, port: int) -> list[str]:
    return ["--nnodes", str(nnodes), "--node-rank", str(node), "--port", str(port)] if nnodes > 1 else []


def run_job(run_dir: Path, args: list[str], *, timeout_s: float, nnodes: int = 1) -> JobResult:
    """One `unbroken run` per node, each in its own process group (several nodes: supervisors on
    loopback sharing the run dir); node 0's summary is the job's. On timeout every group is
    killed. Nothing of the job outlives this call."""
    run_dir = run_dir.resolve()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    port = free_port() if nnodes > 1 else 0
    base = [sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir), "--no-progress", "--json", *args]
    t0 = time.monotonic()
    procs = []
    for n in range(nnodes):
        # a joiner's output goes to a file: an unread pipe that fills would block its supervisor
        out_to = subprocess.PIPE if n == 0 else open(run_dir.parent / f"{run_dir.name}.node{n}.log", "w")
        procs.append(subprocess.Popen(base + node_args(nnodes, n, port), stdout=out_to,
                                      stderr=subprocess.PIPE if n == 0 else subprocess.STDOUT, text=True,
                                      start_new_session=True))
        if n > 0:
            out_to.close()
        if n == 0 and nnodes > 1:
            _wait_for_node0(run_dir, procs[0])  # node 0 creates the run dir; a joiner must not first
    proc = procs[0]
    try:
        out, err = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
        for p in procs:
            _kill_group(p.pid)
        kill_leftovers(run_dir)  # then nobody holds the pipes open
        try:
            out, err = proc.communicate(timeout=REAP_S)
        except subprocess.TimeoutExpired:
            out, err = "", "(node 0's output pipe still held open after its group was killed)"
    finally:
        wall = time.monotonic() - t0
        for p in procs:  # anything a job left in its group after its supervisor exited; a frozen node
            _kill_group(p.pid)
            if p.poll() is None:
                p.kill()
            try:
                p.communicate(timeout=REAP_S)
            except subprocess.TimeoutExpired:
                pass  # reported by kill_leftovers below if anything of the job survives
        kill_leftovers(run_dir)
    return JobResult(rc=rc, summary=_parse_summary(out), wall_s=wall, stderr_tail=err[-2000:],
                     fired=_fired(run_dir))


def _wait_for_node0(run_dir: Path, node0: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until node 0 has started its run (its events file exists), it exits, or timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and node0.poll() is None and not (run_dir / "events.jsonl").exists():
        time.sleep(0.02)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def procs_under(root: Path) -> list[int]:
    """Pids whose UNBROKEN_RUN_DIR (every process a job starts has it) is root or lies below it."""
    var = f"UNBROKEN_RUN_DIR={root}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v == var or v.startswith(var + b"/") for v in env):
            pids.append(int(d.name))
    return pids


def kill_leftovers(run_dir: Path) -> list[int]:
    """SIGKILL every process still carrying this run dir (a shadow that escaped the group,
    say) and wait until they are gone; returns the pids found."""
    found = procs_under(run_dir)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + REAP_S
    while procs_under(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = procs_under(run_dir)
    assert not left, f"processes of {run_dir} survive SIGKILL for {REAP_S}s: {left}"
    return found


def _parse_summary(stdout: str) -> dict | None:
    try:
        s = json.loads(stdout)
    except json.JSONDecodeError:
        return None
    return s if isinstance(s, dict) else None


def _fired(run_dir: Path) -> list[str]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    fired = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a SIGKILL
        if e.get("kind") == "fault_injected":
            f = e["fields"]
            fired.append(f"{f['fault']}:rank={e['rank']},step={f['step']},phase={f['phase']},chunk={f['chunk']}")
    return fired


def classify(res: JobResult, *, reference_sha: str, world_size: int) -> tuple[str, str]:
    """(outcome, reason) of one schedule's job against the reference's weights."""
    s = res.summary
    if res.rc is None:
        return "hung", "timed out; its process group was killed"
    if s is not None and len(s.get("rank_weights_sha256") or {}) == world_size:  # every rank finished
        if not s.get("ranks_agree"):
            return "divergent", "the ranks' final weights differ"
        if s.get("weights_sha256") != reference_sha:
            return "divergent", f"weights sha256 {s.get('weights_sha256')} != reference {reference_sha}"
    if res.rc != 0 or s is None or not s.get("ok"):
        last = res.stderr_tail.strip().splitlines()[-1:] or ["(no stderr)"]
        return "failed", f"exit {res.rc}, ok={None if s is None else s.get('ok')}: {last[0][:300]}"
    if s.get("steps_lost") != 0:
        return "failed", f"steps_lost={s.get('steps_lost')} (None: not measured, a recovery incomplete)"
    return "passed", ""


def reproduce(args: list[str], sched: Schedule, nnodes: int = 1) -> str:
    """The command line(s): one `unbroken run` per node (a free port in place of 29511)."""
    injects = [x for spec in sched.specs for x in ("--inject", spec)]
    if nnodes == 1:
        return shlex.join(["unbroken", "run", *args, *injects])
    # one shared run dir; node 0 first (in the background), joiners a moment later
    lines = [shlex.join(["unbroken", "run", "--run-dir", "runs/chaos-repro", *args, *injects,
                         *node_args(nnodes, n, 29511)]) for n in range(nnodes)]
    return f"{lines[0]} & sleep 2; " + " & ".join(lines[1:]) + "; wait"


def run_schedule(sched: Schedule, root: Path, args: list[str], *, reference_sha: str, world_size: int,
                 timeout_s: float, nnodes: int = 1) -> dict:
    """Run one schedule; its record for `per_schedule`."""
    run_dir = root / f"{sched.index:03d}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    res = run_job(run_dir, [*args, *(x for spec in sched.specs for x in ("--inject", spec))], timeout_s=timeout_s,
                  nnodes=nnodes)
    outcome, reason = classify(res, reference_sha=reference_sha, world_size=world_size)
    s = res.summary or {}
    return {"index": sched.index, "pattern": sched.pattern, "specs": sched.specs, "outcome": outcome,
            "reason": reason, "wall_s": round(res.wall_s, 3), "steps_lost": s.get("steps_lost"),
            "recoveries": len(s.get("recoveries") or []), "unfired": [x for x in sched.specs if x not in res.fired],
            "run_dir": str(run_dir.resolve()), "reproduce": reproduce(args, sched, nnodes)}


def run_chaos(a: ChaosArgs, *, out: Path, work_dir: Path,
              echo: Callable[[str], None] = print, reference_sha: str | None = None) -> dict:
    """Reference, then every schedule; writes the record to `out` and returns it. Run dirs go
    under `work_dir`; a passing run's dir is removed. `reference_sha` skips the reference run."""
    t0 = time.monotonic()
    config = out.with_suffix(".toml")  # next to the record: its reproduce commands name it
    atomic_write_bytes(config, config_text().encode())
    args = a.job_args(config)
    if reference_sha is None:
        reference_sha = _reference(work_dir / "reference", args, a.timeout_s, a.nnodes)
    per = []
    for sched in schedules(a.seed, a.runs, a.shape):
        rec = run_schedule(sched, work_dir, args, reference_sha=reference_sha, world_size=a.world_size,
                           timeout_s=a.timeout_s, nnodes=a.nnodes)
        if rec["outcome"] == "passed":
            shutil.rmtree(rec.pop("run_dir"), ignore_errors=True)
        echo(_line(rec))
        per.append(rec)
    counts = {k: sum(r["outcome"] == k for r in per) for k in OUTCOMES}
    record = {"schedules": a.runs, **counts, "seed": a.seed,
              "steps_lost": sum(r["steps_lost"] or 0 for r in per),
              "steps_lost_unmeasured": sum(r["steps_lost"] is None for r in per),
              "unfired": sum(bool(r["unfired"]) for r in per),
              "args": {**asdict(a), "job": args, "config": CONFIG}, "reference_sha256": reference_sha,
              "per_schedule": per, "machine": machine(), **git_commit(), "wall_s": round(time.monotonic() - t0, 3)}
    atomic_write_json(out, record)
    return record


def _reference(run_dir: Path, args: list[str], timeout_s: float, nnodes: int = 1) -> str:
    res = run_job(run_dir, args, timeout_s=timeout_s, nnodes=nnodes)
    s = res.summary or {}
    if res.rc != 0 or not s.get("ok") or not s.get("weights_sha256"):
        raise ReferenceFailed(f"the failure-free reference run failed (exit {res.rc}, run dir {run_dir}): "
                              f"{res.stderr_tail.strip()[-300:]}")
    return s["weights_sha256"]


class ReferenceFailed(RuntimeError):
    """The failure-free run did not complete: no schedule can be judged."""


def _line(rec: dict) -> str:
    note = f"  (did not fire: {' '.join(rec['unfired'])})" if rec["unfired"] else ""
    return f"{rec['index']:4d} {rec['outcome']:<9} {rec['wall_s']:6.1f}s  {' '.join(rec['specs'])}{note}"


def report(record: dict, echo: Callable[[str], None] = print) -> None:
    """The closing lines: `N passed, M failed`, then how to reproduce each one that did not pass."""
    bad = [r for r in record["per_schedule"] if r["outcome"] != "passed"]
    echo(f"{record['passed']} passed, {len(bad)} failed "
         f"({record['divergent']} divergent, {record['hung']} hung, {record['failed']} failed; "
         f"steps lost {record['steps_lost']}, unmeasured in {record['steps_lost_unmeasured']})")
    for r in bad:
        echo(f"schedule {r['index']} {r['outcome']}: {r['reason']}\n  run dir: {r.get('run_dir')}\n  {r['reproduce']}")


def chaos(
    runs: int = typer.Option(20, "--runs", help="number of random schedules"),
    seed: int = typer.Option(0, "--seed", help="schedule i is a function of (seed, i) only"),
    steps: int = typer.Option(12, "--steps", help="training steps per job"),
    world_size: int = typer.Option(4, "--world-size"),
    parity_group: int = typer.Option(2, "--parity-group"),
    timeout_s: float = typer.Option(120.0, "--timeout-s", help="wall-clock limit per job; past it: hung"),
    nnodes: int = typer.Option(1, "--nnodes", help="supervisors per job (on loopback); > 1 adds whole-node losses"),
    out: Path = typer.Option(Path("bench/results/chaos.json"), "--out", help="the JSON record"),
    keep_runs: Optional[Path] = typer.Option(None, "--keep-runs", help="keep every run dir under DIR"),
) -> None:
    """Random fault schedules (sigkill, sigstop, exception, nan, linkdrop; with --nnodes > 1 whole-node
    losses), each compared bitwise with a failure-free run."""
    try:
        a = ChaosArgs(runs=runs, seed=seed, steps=steps, world_size=world_size, parity_group=parity_group,
                      timeout_s=timeout_s, nnodes=nnodes)
    except ValueError as e:
        fail(str(e))
    work = keep_runs or Path(tempfile.mkdtemp(prefix="unbroken-chaos-"))
    try:
        record = run_chaos(a, out=out, work_dir=work.resolve(), echo=lambda s: print(s, flush=True))
    except ReferenceFailed as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1)
    if keep_runs is None and record["passed"] == record["schedules"]:
        shutil.rmtree(work, ignore_errors=True)
    report(record)
    print(f"wrote {out}")
    if record["passed"] != record["schedules"]:
        raise typer.Exit(1)
