"""`unbroken bench serve`: twin vs real server, the random forest, and greedy vs round-robin vs random
adapter placement on a small real fleet; writes bench/results/serve.json and serve.png."""
from __future__ import annotations

from pathlib import Path

import typer

from unbroken.cli_error import fail


def serve(duration: float = typer.Option(12.0, "--duration", help="seconds of load per real run"),
          train_runs: int = typer.Option(2000, "--train-runs", help="twin runs the random forest learns from"),
          out_dir: Path = typer.Option(Path("bench/results"), "--out-dir")) -> None:
    """Multi-adapter serving: digital twin, random forest and placement, measured on a real fleet."""
    if not 0 < duration <= 120 or train_runs < 20:
        fail(f"--duration must be in (0, 120] s and --train-runs >= 20, got {duration} and {train_runs}")
    from unbroken.bench.serve_study import run_study  # aiohttp, scikit-learn: only when this runs

    run_study(duration, train_runs, out_dir)
