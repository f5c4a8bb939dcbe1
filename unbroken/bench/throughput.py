"""Training throughput (tokens/s) of the tiny-GPT job at 1, 2 and 4 ranks, in one invocation.

Next to each unbroken run: the same model and batches as a plain torchrun + DDP job
(`baseline_job.py`, no failures, no mid-run checkpoints), so the ratio shows what the
runtime itself costs.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from unbroken.bench import baseline
from unbroken.bench.common import median, run_job, steady_step_times, job_events
from unbroken.config import RunConfig

RANKS = (1, 2, 4)


def throughput_result(per_rank: dict[int, dict], *, steps: int) -> dict:
    """The JSON schema: {"ranks": {"1": tokens/s, ...}, "steps": n, "ddp_baseline": {...}, ...}.

    per_rank[n] has unbroken's tokens_per_s, wall_s, median_step_s, and ddp_tokens_per_s.
    """
    if not per_rank:
        raise ValueError("throughput_result needs at least one measured rank count")
    base_n = min(per_rank)
    base = per_rank[base_n]["tokens_per_s"]
    return {
        "steps": steps,
        "ranks": {str(n): r["tokens_per_s"] for n, r in sorted(per_rank.items())},
        "detail": {str(n): r for n, r in sorted(per_rank.items())},
        # aggregate tokens/s relative to the smallest world; 1.0 = no gain from more ranks
        "scaling": {str(n): r["tokens_per_s"] / base for n, r in sorted(per_rank.items())},
        "per_rank_efficiency": {str(n): r["tokens_per_s"] / base / (n / base_n) for n, r in sorted(per_rank.items())},
        "ddp_baseline": {str(n): r["ddp_tokens_per_s"] for n, r in sorted(per_rank.items())},
        "unbroken_vs_ddp": {str(n): r["tokens_per_s"] / r["ddp_tokens_per_s"] for n, r in sorted(per_rank.items())},
    }


def measure(*, steps: int, ranks: tuple[int, ...] = RANKS, console: Console | None = None) -> dict:
    console = console or Console(stderr=True)
    per_rank: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-tput-") as tmp:
        for n in ranks:
            console.log(f"throughput: {n} rank(s), {steps} steps")
            cfg = RunConfig(world_size=n, steps=steps)
            run_dir = Path(tmp) / f"w{n}"
            s = run_job(cfg, run_dir, console=console)
            if not s["ok"]:
                raise RuntimeError(f"the {n}-rank throughput run did not finish (see {run_dir}/events.jsonl)")
            tokens = n * cfg.batch_size * cfg.model.seq_len
            console.log(f"throughput: {n} rank(s), torchrun + DDP baseline")
            ddp = baseline.run_baseline(cfg, Path(tmp) / f"ddp{n}", every=steps)
            per_rank[n] = {"tokens_per_s": s["tokens_per_s"], "wall_s": s["wall_s"],
                           "median_step_s": median(steady_step_times(job_events(run_dir))),
                           "tokens_per_step": tokens,
                           "ddp_tokens_per_s": baseline.throughput(ddp["records"], tokens),
                           "ddp_median_step_s": median(baseline.step_times(ddp["records"]))}
    return throughput_result(per_rank, steps=steps)


def table(res: dict) -> Table:
    t = Table(title=f"throughput, tiny GPT, {res['steps']} steps per run (same job, one invocation)")
    for col in ("ranks", "unbroken tok/s", "vs 1 rank", "per-rank eff.", "median step s", "torchrun+DDP tok/s",
                "unbroken / DDP"):
        t.add_column(col, justify="right")
    for n, tps in res["ranks"].items():
        d = res["detail"][n]
        t.add_row(n, f"{tps:.0f}", f"{res['scaling'][n]:.2f}x", f"{res['per_rank_efficiency'][n]:.2f}",
                  f"{d['median_step_s']:.3f}" if d["median_step_s"] is not None else "-",
                  f"{res['ddp_baseline'][n]:.0f}", f"{res['unbroken_vs_ddp'][n]:.2f}")
    return t
