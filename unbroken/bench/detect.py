"""`unbroken bench detect`: false positives in a failure-free soak, detection latency, a real straggler.

1. soak: a failure-free run at default thresholds; every `fault_detected` is a false positive.
2. latency: SIGKILL and SIGSTOP one rank; injection -> detection, in heartbeat intervals (goal <= 2).
3. straggler: rank 2 is throttled for real (pinned to one core with busy-loop siblings, the other
   ranks on the other core); it must be flagged as a straggler and replaced.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from unbroken.bench.common import fmt, job_events, run_job, write_result
from unbroken.config import ModelConfig, RunConfig
from unbroken.runtime.faults import FaultSpec

_SMALL = ModelConfig(n_layer=2, n_embd=64)


def _latency(kind: str, root: Path, console: Console) -> dict:
    cfg = RunConfig(steps=12, batch_size=4, chunk_kb=16, model=_SMALL)
    run_job(cfg, root / kind, faults=(FaultSpec.parse(f"{kind}:rank=2,step=6,phase=backward"),), console=console)
    evs = job_events(root / kind)
    injected = next(e for e in evs if e.kind == "fault_injected")
    detected = next(e for e in evs if e.kind == "fault_detected")
    lat = detected.time - injected.time
    return {"fault": detected.fields["fault"], "latency_s": lat, "heartbeats": lat / cfg.heartbeat_s,
            "heartbeat_s": cfg.heartbeat_s}


def _soak(steps: int, root: Path, console: Console) -> dict:
    cfg = RunConfig(steps=steps)
    t0 = time.time()
    summary = run_job(cfg, root / "soak", console=console)
    wall = time.time() - t0
    fps = [e for e in job_events(root / "soak") if e.kind == "fault_detected"]
    return {"steps": steps, "wall_s": wall, "false_positives": len(fps),
            "false_positives_per_day": len(fps) * 86400 / wall, "ok": summary.get("ok"),
            "findings": [e.fields for e in fps]}


def _pin(pid: int, cpu: int, *, main_only: bool = False) -> None:
    """Pin `pid`'s threads to one CPU (only its main, compute thread if `main_only`)."""
    try:
        tids = [pid] if main_only else [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {cpu})
        except OSError:
            pass


def _straggler(steps: int, root: Path, hogs: int) -> dict:
    """Run in a subprocess; once rank 2 exists, pin it with `hogs` busy loops to CPU 1."""
    if (os.cpu_count() or 1) < 2:
        return {"skipped": "needs 2 CPUs"}
    run_dir = root / "straggler"
    # The default model: compute-bound steps, so throttling one rank's CPU shows in its busy time.
    cmd = [sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir), "--no-progress", "--json",
           "--steps", str(steps)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    busy = []
    try:
        pids = _wait_worker_pids(run_dir, timeout_s=120)
        for rank, pid in pids.items():
            # rank 2's compute thread shares CPU 1 with the busy loops; its gloo threads stay free,
            # so the slowness shows as compute (a slow GPU), not as slow communication
            _pin(pid, 1 if rank == 2 else 0, main_only=rank == 2)
        for _ in range(hogs):
            p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            _pin(p.pid, 1)
            busy.append(p)
        out, _ = job.communicate(timeout=600)
    finally:
        for p in busy:
            p.send_signal(signal.SIGKILL)
            p.wait()
        if job.poll() is None:
            job.kill()
    evs = job_events(run_dir)
    found = [e for e in evs if e.kind == "fault_detected" and e.fields.get("fault") == "straggler"]
    return {"hogs": hogs, "flagged": bool(found), "rank": found[0].rank if found else None,
            "evidence": found[0].fields.get("evidence") if found else None,
            "job_ok": json.loads(out).get("ok") if out.strip() else False}


def _wait_worker_pids(run_dir: Path, timeout_s: float) -> dict[int, int]:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if (run_dir / "events.jsonl").exists():
            pids = {e.rank: e.fields["pid"] for e in job_events(run_dir)
                    if e.kind == "process_started" and e.fields.get("role") == "worker" and e.source == "supervisor"}
            if len(pids) == 4:
                return pids
        time.sleep(0.05)
    raise TimeoutError(f"the straggler job did not start its 4 workers within {timeout_s:.0f}s")


def run(quick: bool, out: Path, console: Console) -> dict:
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-detect-") as tmp:
        root = Path(tmp)
        res = {"latency": {k: _latency(k, root, console) for k in ("sigkill", "sigstop")},
               "soak": _soak(40 if quick else 300, root, console),
               "straggler": _straggler(40 if quick else 50, root, hogs=4)}
    table = Table(title="detection")
    table.add_column("measure")
    table.add_column("value")
    table.add_column("goal")
    for k, v in res["latency"].items():
        table.add_row(f"{k} -> {v['fault']} detected", f"{fmt(v['latency_s'])} s = {fmt(v['heartbeats'], 2)} heartbeats",
                      "<= 2 heartbeats")
    s = res["soak"]
    table.add_row(f"soak: {s['steps']} steps, {fmt(s['wall_s'], 0)} s", f"{s['false_positives']} false positives", "0")
    g = res["straggler"]
    table.add_row("throttled rank 2 flagged as straggler", f"{g.get('flagged')} (rank {g.get('rank')})", "True")
    console.print(table)
    write_result("detect", res, out)
    return res


def detect(quick: bool = typer.Option(False, "--quick", help="short soak (40 steps) for a smoke run"),
           out: Path = typer.Option(Path("bench/results"), "--out", help="where detect.json goes")) -> None:
    """Detection: failure-free soak (false positives), latency of crash/hang detection, a real straggler."""
    run(quick, out, Console())
