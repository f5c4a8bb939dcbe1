"""Multi-process test helpers: run the real CLI, and make sure no process is left behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SMALL = ["--n-layer", "2", "--n-embd", "64", "--batch-size", "4", "--steps", "8", "--world-size", "4",
         "--chunk-kb", "16"]


def _procs_of(run_dir: Path) -> list[int]:
    """Pids whose environment names this run directory."""
    needle = f"UNBROKEN_RUN_DIR={run_dir}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes():
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def run_cli(run_dir: Path, *args: str, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir), "--no-progress", "--json", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    finally:
        leftover = _procs_of(run_dir.resolve())
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leftover and check:
            time.sleep(0.2)
            pytest.fail(f"processes left behind by the run in {run_dir}: {leftover}")


def run_job(run_dir: Path, *args: str, timeout: float = 240) -> dict:
    p = run_cli(run_dir, *args, timeout=timeout)
    assert p.returncode == 0, f"run failed ({p.returncode}):\n{p.stderr[-3000:]}\n{_logs(run_dir)}"
    return json.loads(p.stdout)


def _logs(run_dir: Path) -> str:
    out = []
    for f in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []:
        lines = [ln for ln in f.read_text(errors="replace").splitlines() if "socket.cpp" not in ln]
        out.append(f"--- {f.name}\n" + "\n".join(lines[-12:]))
    return "\n".join(out)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict:
    """Failure-free runs (zero1 and ddp) whose final weights every faulted run must equal."""
    root = tmp_path_factory.mktemp("reference")
    return {s: run_job(root / s, *SMALL, "--strategy", s, "--checkpoint-every", "2") for s in ("zero1", "ddp")}
