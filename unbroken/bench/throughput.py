"""Training throughput (tokens/s) of the tiny-GPT job at 1, 2 and 4 ranks, in one invocation.

This is unbroken's scaling with the number of ranks, nothing more. The comparison with the
native PyTorch peers (DDP, ZeRO-1) under torchrun is `unbroken bench overhead`
(`overhead.py`), which interleaves the variants and reports a confidence interval.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from unbroken.bench.common import job_events, median, run_job, steady_step_times
from unbroken.config import RunConfig

RANKS = (1, 2, 4)


def throughput_result(per_rank: dict[int, dict], *, steps: int) -> dict:
    """The JSON schema: {"ranks": {"1": tokens/s, ...}, "steps": n, "scaling": {...}, ...}.

    per_rank[n] has unbroken's tokens_per_s, wall_s, median_step_s and tokens_per_step.
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
    }


def measure_world(n: int, *, steps: int, run_dir: Path, console: Console) -> dict:
    """One unbroken run at n ranks: its tokens/s, wall time and median steady step time."""
    console.log(f"throughput: {n} rank(s), {steps} steps")
    cfg = RunConfig(world_size=n, steps=steps)
    s = run_job(cfg, run_dir, console=console)
    if not s["ok"]:
        raise RuntimeError(f"the {n}-rank throughput run did not finish (see {run_dir}/events.jsonl)")
    return {"tokens_per_s": s["tokens_per_s"], "wall_s": s["wall_s"],
            "median_step_s": median(steady_step_times(job_events(run_dir))),
            "tokens_per_step": n * cfg.batch_size * cfg.model.seq_len}


def measure(*, steps: int, ranks: tuple[int, ...] = RANKS, console: Console | None = None) -> dict:
    console = console or Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-tput-") as tmp:
        per_rank = {n: measure_world(n, steps=steps, run_dir=Path(tmp) / f"w{n}", console=console) for n in ranks}
    return throughput_result(per_rank, steps=steps)


def table(res: dict) -> Table:
    t = Table(title=f"throughput, tiny GPT, {res['steps']} steps per run (same job, one invocation)")
    for col in ("ranks", "unbroken tok/s", "vs 1 rank", "per-rank eff.", "median step s"):
        t.add_column(col, justify="right")
    for n, tps in res["ranks"].items():
        d = res["detail"][n]
        t.add_row(n, f"{tps:.0f}", f"{res['scaling'][n]:.2f}x", f"{res['per_rank_efficiency'][n]:.2f}",
                  f"{d['median_step_s']:.3f}" if d["median_step_s"] is not None else "-")
    return t
