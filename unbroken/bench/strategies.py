"""`unbroken bench strategies`: each unbroken strategy next to PyTorch's own, in one invocation.

For every strategy the same tiny-GPT job (same model, batches, schedule and clipping) runs
two ways, interleaved round by round (native, unbroken, native, unbroken, ...), so the
shared machine's drift hits both alike:

    ddp    torch DDP + AdamW                                  vs unbroken --strategy ddp
    zero1  torch DDP + ZeroRedundancyOptimizer(AdamW)         vs unbroken --strategy zero1
    zero2  FSDP2 fully_shard(reshard_after_forward=False)     vs unbroken --strategy zero2
    zero3  FSDP2 fully_shard(reshard_after_forward=True)      vs unbroken --strategy zero3
    fsdp   FSDP2 fully_shard(reshard_after_forward=True)      vs unbroken --strategy fsdp (the same
           fully_shard, its collectives over unbroken's groups, its state protected)

unbroken runs as a user gets it (RunConfig defaults: tier-1 parity, tier-2 checkpoints);
the native peer runs failure-free without checkpoints. Per pair:

- throughput: mean steady step time, native / unbroken (> 1: unbroken is faster), with the
  two-stage paired bootstrap CI of `bench/overhead.py`;
- memory per rank: the highest peak RSS over the ranks, and the live tensor bytes at the
  end of the last step (parameters, gradients, optimizer state, communication and
  protection buffers: `unbroken.memory`), each as unbroken / native; unbroken's protection
  memory (the worker_done event's `protection_bytes`: tier-1 parity and its pipeline windows,
  the snapshot parity encodes, the gradient ring, the host staging of tier-2 checkpoints; the
  most any rank holds) is reported beside it, as the goal allows it;
- bytes on the wire per step: each job runs in a network namespace of its own (`unshare
  --net`, loopback only), whose loopback counter holds exactly that job's traffic, set-up
  and store included, divided by its steps. Without root the field is null, with why.

Goal (issue 16): ratio >= 0.98 and memory <= 1.05x the peer's plus the protection memory.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from unbroken.bench import native_job
from unbroken.bench.baseline import read_log, run_torchrun
from unbroken.bench.common import SKIP_STEPS, fmt, free_port, goal
from unbroken.bench.overhead import bootstrap_ci, mean_ratio
from unbroken.config import RunConfig
from unbroken.fsutil import atomic_write_json

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
GOAL_RATIO, GOAL_MEMORY = 0.98, 1.05
# /proc/net/dev is the calling process's namespace (sysfs would show the host's loopback)
_COUNT = ('ip link set lo up && "$@"; rc=$?; '
          'sed "s/:/ /" /proc/net/dev | awk \'$1 == "lo" {print $10}\' > "$TX_OUT"; exit $rc')


def netns_reason() -> str | None:
    """Why jobs cannot run in their own network namespace here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (unshare --net) to count one job's bytes on its own loopback"
    if not (shutil.which("unshare") and shutil.which("ip")):
        return "needs unshare (util-linux) and ip (iproute2)"
    return None


def _counted(cmd: list[str], tx_file: Path) -> list[str]:
    if netns_reason() is not None:
        return cmd
    return ["unshare", "--net", "--", "env", f"TX_OUT={tx_file}", "sh", "-c", _COUNT, "sh", *cmd]


def _tx_bytes(tx_file: Path) -> int | None:
    return int(tx_file.read_text()) if tx_file.exists() else None


def run_native(cfg: RunConfig, run_dir: Path, optimizer: str, *, timeout_s: float = 900) -> dict:
    run_dir.mkdir(parents=True)
    atomic_write_json(run_dir / "config.json", cfg.to_dict())
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "PYTHONUNBUFFERED": "1"}
    cmd = native_job.native_command(run_dir, nproc=cfg.world_size, port=free_port(), optimizer=optimizer)
    tx = run_dir / "tx_bytes"
    t0 = time.time()
    run_torchrun(_counted(cmd, tx), env, run_dir, timeout_s=timeout_s, what=f"native peer ({optimizer})")
    recs = read_log(run_dir)
    mem = [r for r in recs if r["event"] == "memory"]
    return {"wall_s": time.time() - t0, "step_s": [r["step_s"] for r in native_job.step_records(recs)],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in mem),
            "tensor_bytes": max(r["tensor_bytes"] for r in mem), "tx_bytes": _tx_bytes(tx)}


def run_unbroken(cfg: RunConfig, run_dir: Path, *, timeout_s: float = 900) -> dict:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    conf = run_dir.parent / f"{run_dir.name}.json"
    atomic_write_json(conf, cfg.to_dict())
    tx = run_dir.parent / f"{run_dir.name}.tx"
    cmd = [sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir), "--config", str(conf),
           "--no-progress", "--json"]
    t0 = time.time()
    p = subprocess.run(_counted(cmd, tx), capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"unbroken {cfg.strategy} exited {p.returncode}: {p.stderr.strip()[-400:]}")
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    steps = {e["fields"]["step"]: e["fields"]["step_s"] for e in events if e["kind"] == "step" and e["rank"] == 0}
    done = [e["fields"] for e in events if e["kind"] == "worker_done"]
    # the most any rank holds for protection (rank 0 alone stages a replica's checkpoint)
    protection = max(sum(d["protection_bytes"].values()) for d in done)
    parts = {k: max(d["protection_bytes"][k] for d in done) for k in done[0]["protection_bytes"]}
    return {"wall_s": time.time() - t0, "step_s": [steps[s] for s in sorted(steps)],
            "peak_rss_bytes": max(d["peak_rss_bytes"] for d in done),
            "tensor_bytes": max(d["tensor_bytes"] for d in done), "protection_bytes": protection,
            "protection_parts": parts, "tx_bytes": _tx_bytes(tx)}


def measure(*, steps: int, rounds: int, world: int, strategies: list[str], console: Console) -> dict:
    runs: dict[str, dict[str, list]] = {s: {"native": [], "unbroken": []} for s in strategies}
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-strategies-") as tmp:
        for rnd in range(rounds):
            for s in strategies:
                cfg = RunConfig(strategy=s, world_size=world, steps=steps)
                peer = native_job.peer_for(s)
                console.log(f"strategies: round {rnd + 1}/{rounds}, {s}: native ({peer['short']})")
                native = RunConfig(strategy=s, world_size=world, steps=steps, tier1=False, checkpoint_every=0)
                runs[s]["native"].append(run_native(native, Path(tmp) / f"{s}-native-{rnd}", peer["optimizer"]))
                console.log(f"strategies: round {rnd + 1}/{rounds}, {s}: unbroken")
                runs[s]["unbroken"].append(run_unbroken(cfg, Path(tmp) / f"{s}-unbroken-{rnd}"))
    return result(runs, steps=steps, rounds=rounds, world=world)


def _ratio(runs: list[dict], key: str, num: list[dict]) -> float:
    return statistics.fmean(r[key] for r in runs) / statistics.fmean(r[key] for r in num)


def pair_result(pair: dict, steps: int) -> dict:
    """One strategy's figures from its rounds of native and unbroken runs."""
    nat, ub = pair["native"], pair["unbroken"]
    t_nat = [r["step_s"][SKIP_STEPS:] for r in nat]
    t_ub = [r["step_s"][SKIP_STEPS:] for r in ub]
    ratio = mean_ratio(t_nat, t_ub)
    mem = _ratio(ub, "peak_rss_bytes", nat)
    protection = max(r["protection_bytes"] for r in ub)
    allowed = (GOAL_MEMORY * statistics.fmean(r["peak_rss_bytes"] for r in nat) + protection) \
        / statistics.fmean(r["peak_rss_bytes"] for r in nat)
    tx = {side: (statistics.fmean(r["tx_bytes"] / steps for r in rs) if all(r["tx_bytes"] for r in rs) else None)
          for side, rs in (("native", nat), ("unbroken", ub))}
    return {"ratio": ratio, "ci95": list(bootstrap_ci(t_nat, t_ub)), "memory_ratio": mem,
            "memory_ratio_allowed": allowed, "tensor_ratio": _ratio(ub, "tensor_bytes", nat),
            "protection_bytes": protection, "protection_parts": ub[-1]["protection_parts"],
            "peak_rss_bytes": {"native": [r["peak_rss_bytes"] for r in nat], "unbroken": [r["peak_rss_bytes"] for r in ub]},
            "tensor_bytes": {"native": [r["tensor_bytes"] for r in nat], "unbroken": [r["tensor_bytes"] for r in ub]},
            "bytes_per_step": tx,
            "goal_met": ratio >= GOAL_RATIO and mem <= allowed,
            "mean_step_s": {"native": statistics.fmean(x for r in t_nat for x in r),
                            "unbroken": statistics.fmean(x for r in t_ub for x in r)},
            "samples": {"native": t_nat, "unbroken": t_ub}}


def result(runs: dict, *, steps: int, rounds: int, world: int) -> dict:
    per = {s: pair_result(p, steps) for s, p in runs.items()}
    return {"ratio_vs_native": {s: r["ratio"] for s, r in per.items()},
            "ci95": {s: r["ci95"] for s, r in per.items()},
            "memory_ratio_vs_native": {s: r["memory_ratio"] for s, r in per.items()},
            "memory_ratio_allowed": {s: r["memory_ratio_allowed"] for s, r in per.items()},
            "tensor_ratio_vs_native": {s: r["tensor_ratio"] for s, r in per.items()},
            "goal_met": {s: r["goal_met"] for s, r in per.items()}, "goal_ratio": GOAL_RATIO,
            "goal_memory": GOAL_MEMORY, "peer": {s: native_job.peer_for(s)["peer"] for s in runs},
            "not_built": {},  # every strategy of issue 16 is built (kept: the record's schema)
            "bytes_counted": netns_reason() or "per job, on its own network namespace's loopback",
            "world_size": world, "steps": steps, "rounds": rounds, "skip_steps": SKIP_STEPS, "per_strategy": per}


def table(res: dict) -> Table:
    t = Table(title=f"unbroken strategies vs PyTorch's own ({res['world_size']} ranks, {res['rounds']} rounds)")
    for col in ("strategy", "native peer", "tokens/s ratio [95% CI]", "peak RSS ratio (allowed)", "tensor bytes ratio",
                "MB/step native", "MB/step unbroken", "goal"):
        t.add_column(col)
    for s, r in res["per_strategy"].items():
        mb = {k: "-" if v is None else fmt(v / 1e6) for k, v in r["bytes_per_step"].items()}
        t.add_row(s, res["peer"][s], f"{r['ratio']:.3f} [{r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}]",
                  f"{r['memory_ratio']:.3f} ({r['memory_ratio_allowed']:.3f})", f"{r['tensor_ratio']:.2f}",
                  mb["native"], mb["unbroken"], goal(r["goal_met"]))
    return t
