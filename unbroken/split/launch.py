"""Running GCPSL's cluster workers as one `unbroken run` job (one rank per cluster) from a
parent process, and reading back what the job wrote: the curve, the final weights, the
runtime's summary. The launcher runs in its own session and is reaped on timeout."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from unbroken.fsutil import atomic_write_json
from unbroken.split import job
from unbroken.split.config import SplitConfig
from unbroken.split.train import Curve

TIMEOUT_S = 600.0


class JobFailed(RuntimeError):
    """The `unbroken run` job failed: its exit status and the last line it printed."""

    def __init__(self, message: str, rc: int) -> None:
        super().__init__(message)
        self.rc = rc


@dataclass(frozen=True)
class JobResult:
    curve: Curve
    state: dict
    summary: dict       # the runtime's summary.json (recoveries, weights_sha256, wall_s, ...)
    wall_s: float       # the whole `unbroken run`, start-up included
    startup_s: float    # launch until the first round started


def run_gcpsl(cfg: SplitConfig, method: str, out: Path, *, inject: tuple[str, ...] = (),
              cluster_of: np.ndarray | None = None, timeout_s: float = TIMEOUT_S) -> JobResult:
    """`unbroken run --world-size clusters --strategy ddp job.py` for `method`; raises
    RuntimeError naming the log when the job fails or runs past timeout_s."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {"config": cfg.to_dict(), "method": method, "out": str(out.resolve()),
            "cluster_of": None if cluster_of is None else [int(c) for c in cluster_of]}
    atomic_write_json(out / "spec.json", spec)
    faults = [a for f in inject for a in ("--inject", f)]
    cmd = [sys.executable, "-m", "unbroken.cli", "run", "--world-size", str(cfg.clusters), "--strategy", "ddp",
           "--run-dir", str(out / "run"), "--json", "--no-progress", "--tee", "none", *faults,
           job.__file__, "--spec", str(out / "spec.json")]
    t0 = time.time()
    _run(cmd, out / "launcher.log", timeout_s)
    wall = time.time() - t0
    curve_file = json.loads((out / "curve.json").read_text())
    curve = Curve([tuple(p) for p in curve_file["points"]])
    state = torch.load(out / "final.pt", weights_only=True)
    summary = json.loads((out / "run" / "summary.json").read_text())
    return JobResult(curve, state, summary, wall, curve_file["t0"] - t0)


def _run(cmd: list[str], log: Path, timeout_s: float) -> None:
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's session: supervisor, workers, shadows
            proc.wait(timeout=30)
            raise JobFailed(f"the GCPSL job ran past {timeout_s:.0f} s; see {log}", 1) from None
    if rc != 0:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else "(no output)"
        raise JobFailed(f"the GCPSL job exited {rc}: {last} (full log: {log})", rc)
