"""Run the torchrun baseline (`baseline_job.py`) and read per-kill recovery numbers from its log.

Per kill: recovery_s = kill -> first step completed after the restart (the same end point
unbroken's recovery_s has when it redoes nothing); regain_s = kill -> the killed step
completed again (adds the steps redone since the last checkpoint); and the phases
restart (kill -> new processes exist), init (import torch, rendezvous, load checkpoint),
redo (ready -> first step done).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from unbroken.bench.baseline_job import LOG_NAME
from unbroken.bench.common import free_port, reap_tagged, tagged_env
from unbroken.config import RunConfig
from unbroken.fsutil import atomic_write_json


def torchrun_command(run_dir: Path, *, nproc: int, port: int, every: int, kills: list[tuple[int, int]],
                     max_restarts: int = 10) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--monitor-interval", "0.1", "-m", "unbroken.bench.baseline_job",
           "--run-dir", str(run_dir), "--checkpoint-every", str(every)]
    for rank, step in kills:
        cmd += ["--kill", f"{rank}:{step}"]
    return cmd


def run_torchrun(cmd: list[str], env: dict, run_dir: Path, *, timeout_s: float, what: str) -> None:
    """Run torchrun in its own session, output to run_dir/torchrun.log; reap it (and every worker
    it started) on timeout or interrupt; RuntimeError with the log's last lines if it failed."""
    env, tag = tagged_env(env)
    with open(run_dir / "torchrun.log", "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session: torchrun and the workers it started
            proc.wait()
            raise
        finally:
            reap_tagged(tag)  # a worker torchrun left behind (its own session), waiting on a dead peer
    if rc != 0:
        tail = (run_dir / "torchrun.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"{what} exited {rc}; last lines of {run_dir}/torchrun.log: {tail}")


def run_baseline(cfg: RunConfig, run_dir: Path, *, every: int, kills: list[tuple[int, int]] = (),
                 timeout_s: float = 900) -> dict:
    """Run the job under torchrun to completion; returns wall_s and the log records."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=False)
    atomic_write_json(run_dir / "config.json", cfg.to_dict())
    # Without this gloo cannot re-rendezvous after a restart (pytorch#135712).
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": str(cfg.threads),
           "PYTHONUNBUFFERED": "1"}
    cmd = torchrun_command(run_dir, nproc=cfg.world_size, port=free_port(), every=every, kills=list(kills))
    t0 = time.time()
    run_torchrun(cmd, env, run_dir, timeout_s=timeout_s, what="torchrun baseline")
    wall = time.time() - t0
    return {"wall_s": wall, "t0": t0, "records": read_log(run_dir)}


def read_log(run_dir: Path) -> list[dict]:
    recs = [json.loads(line) for line in (Path(run_dir) / LOG_NAME).read_text().splitlines() if line.strip()]
    return sorted(recs, key=lambda r: r["t"])


def _of(recs: list[dict], event: str, restart: int | None = None) -> list[dict]:
    return [r for r in recs if r["event"] == event and (restart is None or r["restart"] == restart)]


def kill_recoveries(recs: list[dict]) -> list[dict]:
    """One entry per `kill` record, measured from the incarnation that followed it."""
    out = []
    for k in _of(recs, "kill"):
        nxt = k["restart"] + 1
        starts, ready, steps = _of(recs, "process_start", nxt), _of(recs, "ready", nxt), _of(recs, "step", nxt)
        if not (starts and ready and steps):
            raise ValueError(f"kill at step {k['step']} (restart {k['restart']}) has no complete restart after it")
        loaded = ready[0]["loaded_step"]
        before = [r["step"] for r in _of(recs, "step", k["restart"]) if r["t"] <= k["t"]]
        prev = _of(recs, "ready", k["restart"])
        last_done = max(before) if before else (prev[0]["loaded_step"] if prev else 0)
        regain = [r for r in steps if r["step"] == k["step"]]
        t_start, t_ready, t_first = min(r["t"] for r in starts), max(r["t"] for r in ready), steps[0]["t"]
        out.append({
            "rank": k["rank"], "step": k["step"], "kill_t": k["t"], "loaded_step": loaded,
            # counted as unbroken counts them: every step executed again, the interrupted one included
            "steps_redone": k["step"] - loaded, "completed_steps_discarded": last_done - loaded,
            "recovery_s": t_first - k["t"],
            "regain_s": (regain[0]["t"] if regain else t_first) - k["t"],
            "breakdown": {"restart": t_start - k["t"], "init": t_ready - t_start, "redo": t_first - t_ready},
        })
    return out


def step_times(recs: list[dict], skip: int = 2) -> list[float]:
    """Rank 0's step_s, skipping each incarnation's first `skip` steps (warm-up after a start)."""
    out = []
    for restart in sorted({r["restart"] for r in recs}):
        out += [r["step_s"] for r in _of(recs, "step", restart)[skip:]]
    return out


def throughput(recs: list[dict], tokens_per_step: int) -> float:
    """tokens/s over rank 0's steps of the first incarnation, first to last (as unbroken's summary does)."""
    steps = _of(recs, "step", 0)
    if len(steps) < 2:
        raise ValueError("need at least 2 logged steps to measure throughput")
    return tokens_per_step * (len(steps) - 1) / (steps[-1]["t"] - steps[0]["t"])


def summary(run: dict, kills: list[tuple[int, int]], steps: int) -> dict:
    recs = run["records"]
    recs_k = kill_recoveries(recs)
    if len(recs_k) != len(kills):
        raise RuntimeError(f"the baseline logged {len(recs_k)} kills, {len(kills)} were scheduled")
    saves = _of(recs, "checkpoint_saved")
    med = statistics.median(step_times(recs))
    return {
        "recovery_s": [r["recovery_s"] for r in recs_k], "regain_s": [r["regain_s"] for r in recs_k],
        "steps_redone": [r["steps_redone"] for r in recs_k],
        "completed_steps_discarded": [r["completed_steps_discarded"] for r in recs_k],
        "breakdown": {p: [r["breakdown"][p] for r in recs_k] for p in ("restart", "init", "redo")},
        "kills": [{"rank": r["rank"], "step": r["step"], "loaded_step": r["loaded_step"]} for r in recs_k],
        "wall_s": run["wall_s"], "median_step_s": med, "productive_fraction": steps * med / run["wall_s"],
        "checkpoints_saved": len(saves), "checkpoint_s_total": sum(r["save_s"] for r in saves),
        "weights_sha256": weights_sha256(recs),
        "timeline": timeline(recs, run["t0"]),
    }


def weights_sha256(recs: list[dict]) -> str | None:
    done = _of(recs, "done")
    return done[-1]["weights_sha256"] if done else None


def timeline(recs: list[dict], t0: float) -> dict:
    return {"t": [r["t"] - t0 for r in _of(recs, "step")], "step": [r["step"] for r in _of(recs, "step")],
            "kills_t": [r["t"] - t0 for r in _of(recs, "kill")]}
