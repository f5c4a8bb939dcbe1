"""`unbroken bench collectives --only e2e`: the demo job's step time with one slow link, per --collectives.

One rank per network namespace (plan/netns.py), every link at `fast` Mbit/s but rank 1's at `slow`,
the job started per node as a user starts it (`unbroken run --nnodes N`, bench/multinode.py's
launcher), the ddp strategy, no checkpoints. Methods, interleaved round by round: `gloo` (gloo's
all-reduce, unbroken's default, with its default bucket overlap), `static` (our static ring) and
`adaptive` (the congestion-aware all-reduce), each with the job's gradient buckets issued during
backward (ours from a communication thread, comm/bucketed.py). `bucket_kb` (default: the job's,
25 MB, one bucket for the demo's 12.8 MB gradient: nothing to overlap for any method) sets the
bucket size of every method alike (a config file's `bucket_kb`, with `--overlap on`).
step_s: rank 0's mean steady step time (after bench.common.SKIP_STEPS), the median over rounds;
`speedup_vs_gloo` = step_s(gloo) / step_s(adaptive). Written as the `e2e` section of collectives.json.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from unbroken.bench.common import job_events, steady_step_times
from unbroken.config import RunConfig

METHODS = ("gloo", "static", "adaptive")
_PORT = 29851


def measure(*, world: int = 4, fast: float = 1000.0, slow: float = 250.0, steps: int = 20, rounds: int = 2,
            bucket_kb: int | None = None, log=print) -> dict:
    from unbroken.bench.multinode import run_once
    from unbroken.plan.netns import Netns, Wiring

    cfg = RunConfig(world_size=world, steps=steps, strategy="ddp", checkpoint_every=0)
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    n = 0
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-e2e-") as tmp, \
            Netns(Wiring.one_slow("e2e", world, fast, slow, slow_rank=1)) as net:
        extra: tuple[str, ...] = ()
        if bucket_kb is not None:  # every method's buckets alike
            conf = Path(tmp) / "buckets.toml"
            conf.write_text(f"bucket_kb = {int(bucket_kb)}\n")
            extra = ("--config", str(conf), "--overlap", "on")
        for r in range(rounds):
            for m in METHODS:
                log(f"collectives e2e: --collectives {m}, round {r + 1}/{rounds}")
                root = Path(tmp) / f"{m}-{r}"
                root.mkdir()
                n += 1  # a port per run: no TIME_WAIT from the last one
                run_once("unbroken-ddp", net, world, cfg, root, _PORT + 3 * n,
                         ("--collectives", m, "--checkpoint-every", "0", *extra))
                runs[m].append(_record(root / "node0"))
    return result(runs, world=world, fast=fast, slow=slow, steps=steps, rounds=rounds, bucket_kb=bucket_kb)


def _record(run_dir: Path) -> dict:
    events = job_events(run_dir)
    times = steady_step_times(events)
    plans = [e.fields.get("plan") for e in events if e.kind == "collective_plan"]
    return {"step_s": statistics.fmean(times), "steps_timed": len(times), "plan_changes": len(plans),
            "last_plan": plans[-1] if plans else None}


def result(runs: dict[str, list[dict]], *, world: int, fast: float, slow: float, steps: int, rounds: int,
           bucket_kb: int | None = None) -> dict:
    step = {m: statistics.median(r["step_s"] for r in rs) for m, rs in runs.items() if rs}
    return {"world_size": world, "fast_mbit": fast, "slow_mbit": slow, "slow_rank": 1, "steps": steps,
            "rounds": rounds, "strategy": "ddp", "bucket_kb": bucket_kb, "step_s": step, "runs": runs,
            "speedup_vs_gloo": step["gloo"] / step["adaptive"] if {"gloo", "adaptive"} <= set(step) else None,
            "speedup_vs_static": step["static"] / step["adaptive"] if {"static", "adaptive"} <= set(step) else None}
