"""One RL run on a Pool, start to summary: reset every worker to the warm-started policy, run the
coordinator for cfg.steps, and condense what it saw (reward curve, samples/s, the pools' idle
fractions and sizes over time, the length distribution, moves, requeues, redos)."""
from __future__ import annotations

import uuid
from pathlib import Path

from unbroken.events import EventLog
from unbroken.fsutil import atomic_write_bytes
from unbroken.rl.config import METHODS, RLConfig
from unbroken.rl.coordinator import Coordinator
from unbroken.rl.errors import RLInputError
from unbroken.rl.metrics import length_stats
from unbroken.rl.pool import Pool

FINAL_WINDOW = 5


def run(pool: Pool, cfg: RLConfig, method: str, init_state: bytes, out: Path, *, rollout: int | None = None,
        reward: str | None = None, kill_rollout_at: int | None = None, kill_trainer_at: int | None = None,
        controller=None, progress=None, kill_helper_at: int | None = None) -> dict:
    """Run `method` ("static": cfg.rollout / rollout rollout workers, the rest trainers; "dynamic": starts
    there and moves processes; "colocated": every process generates, then every process trains)."""
    if method not in METHODS:
        raise RLInputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if cfg.epochs != 1:  # the pools' update is one optimizer step per step (helpers' gradients are of its weights)
        raise RLInputError(f"epochs={cfg.epochs}: pooled runs take one optimizer step per step; use epochs=1, or "
                           f"the single-process loop (--processes 1) for several")
    rollout = cfg.rollout if rollout is None else rollout
    if method != "colocated":
        RLConfig.check_pools(pool.size, rollout)
    run_id = uuid.uuid4().hex[:8]
    for w in range(pool.size):
        reply = pool.call(w, ("reset", run_id, cfg.to_dict(), init_state, reward))
        if reply[0] == "input_error":
            raise RLInputError(reply[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "events.jsonl").unlink(missing_ok=True)  # this run's events only (`unbroken report OUT`)
    events = EventLog(out / "events.jsonl", source="rl")
    split = (pool.size, pool.size) if method == "colocated" else (rollout, pool.size - rollout)
    events.emit("rl_pools", method=method, rollout=split[0], train=split[1], staleness=_staleness(cfg, method),
                processes=pool.size)
    coord = Coordinator(pool, cfg, method, rollout, events, kill_rollout_at=kill_rollout_at,
                        kill_trainer_at=kill_trainer_at, controller=controller, progress=progress, run_id=run_id,
                        kill_helper_at=kill_helper_at)
    try:
        coord.run()
    finally:
        if coord.latest is not None:  # the newest weights are kept, whether the run ended or stopped
            atomic_write_bytes(out / "policy.pt", coord.latest)
        events.close()
    return summarize(coord, cfg, method, split)


def _staleness(cfg: RLConfig, method: str) -> int:
    return 0 if method == "colocated" else cfg.staleness


def summarize(coord: Coordinator, cfg: RLConfig, method: str, split: tuple[int, int]) -> dict:
    wall = coord.curve[-1]["t"]
    rewards = [c["reward"] for c in coord.curve]
    pools = ("both",) if method == "colocated" else ("rollout", "train")
    return {"method": method, "split": list(split), "staleness": _staleness(cfg, method),
            "max_staleness_seen": max(c["max_staleness"] for c in coord.curve),
            "wall_s": wall, "samples": cfg.steps * cfg.samples_per_step,
            "samples_per_s": cfg.steps * cfg.samples_per_step / wall,
            "tokens_per_s": sum(c["tokens"] for c in coord.curve) / wall,
            "reward_initial": sum(rewards[:FINAL_WINDOW]) / len(rewards[:FINAL_WINDOW]),
            "reward_final": sum(rewards[-FINAL_WINDOW:]) / len(rewards[-FINAL_WINDOW:]),
            "idle": {p: coord.tl.idle_fraction(p, 0.0, wall) for p in pools},
            "pool_sizes": coord.tl.sizes(wall), "moves": coord.moves, "requeues": coord.requeues,
            "redos": coord.redos, "lends": coord.lends, "helps": coord.helps, "lengths": length_stats(coord.lengths),
            "curve": coord.curve}
