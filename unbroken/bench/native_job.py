"""The native PyTorch peer of each unbroken strategy, for `unbroken bench overhead`.

It owns which torch setup a strategy is compared with, launching that setup under torchrun
(`baseline_job.py`: same model, batches, lr schedule and clipping; failure-free, no
checkpoints, no restarts) and reading rank 0's per-step records back:

    ddp    torch DDP + torch.optim.AdamW
    zero1  torch DDP + ZeroRedundancyOptimizer(optimizer_class=torch.optim.AdamW)
    zero2  FSDP2 fully_shard(reshard_after_forward=False) + torch.optim.AdamW
    zero3  FSDP2 fully_shard(reshard_after_forward=True) + torch.optim.AdamW
    fsdp   FSDP2 fully_shard(reshard_after_forward=True) + torch.optim.AdamW (zero3's peer: unbroken's
           fsdp is this very wrapping, under unbroken's protection)

A strategy without a known peer is compared with the ddp peer, and the result says so.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from unbroken.bench.baseline import read_log, run_torchrun, torchrun_command
from unbroken.bench.common import free_port
from unbroken.config import RunConfig
from unbroken.fsutil import atomic_write_json

PEERS: dict[str, dict] = {
    "ddp": {"optimizer": "adamw", "peer": "torch DDP + torch.optim.AdamW", "short": "DDP+AdamW"},
    "zero1": {"optimizer": "zero", "peer": "torch DDP + ZeroRedundancyOptimizer(AdamW)", "short": "DDP+ZeRO"},
    "zero2": {"optimizer": "fsdp2", "peer": "FSDP2 fully_shard(reshard_after_forward=False) + AdamW",
              "short": "FSDP2 (ZeRO-2)"},
    "zero3": {"optimizer": "fsdp2-reshard", "peer": "FSDP2 fully_shard(reshard_after_forward=True) + AdamW",
              "short": "FSDP2 (ZeRO-3)"},
}
PEERS["fsdp"] = PEERS["zero3"]
FALLBACK = "ddp"


def peer_for(strategy: str) -> dict:
    """{"optimizer", "peer", "fallback"}: the native setup `strategy` is measured against."""
    if strategy in PEERS:
        return {**PEERS[strategy], "fallback": False}
    return {**PEERS[FALLBACK], "fallback": True,
            "note": f"no native peer known for {strategy!r}; compared with the {FALLBACK} peer"}


def native_command(run_dir: Path, *, nproc: int, port: int, optimizer: str) -> list[str]:
    """torchrun without restarts, no kills, no checkpoints, the peer's optimizer."""
    cmd = torchrun_command(run_dir, nproc=nproc, port=port, every=0, kills=[], max_restarts=0)
    return cmd + ["--optimizer", optimizer]


def run_native(cfg: RunConfig, run_dir: Path, *, optimizer: str, timeout_s: float = 900) -> dict:
    """Run the peer to completion; returns wall_s and rank 0's step records (all steps, in order)."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=False)
    atomic_write_json(run_dir / "config.json", cfg.to_dict())
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "PYTHONUNBUFFERED": "1"}
    cmd = native_command(run_dir, nproc=cfg.world_size, port=free_port(), optimizer=optimizer)
    t0 = time.time()
    run_torchrun(cmd, env, run_dir, timeout_s=timeout_s, what=f"native peer ({optimizer})")
    wall = time.time() - t0
    return {"wall_s": wall, "records": step_records(read_log(run_dir))}


def step_records(recs: list[dict]) -> list[dict]:
    """Rank 0's `step` records of the first incarnation, by step, without the log's bookkeeping fields."""
    steps = [r for r in recs if r["event"] == "step" and r["rank"] == 0 and r["restart"] == 0]
    drop = {"t", "event", "rank", "restart"}
    return sorted(({k: v for k, v in r.items() if k not in drop} for r in steps), key=lambda r: r["step"])
