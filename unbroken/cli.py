"""The `unbroken` command line: run, demo, bench, report, simulate.

User mistakes print one line naming the problem and the fix and exit with status 2.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from unbroken.config import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Keep PyTorch training productive while hardware fails.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: print ratios side by side, write bench/results/*.json.")
app.add_typer(bench_app, name="bench")
from unbroken.bench.command import throughput, protect, recovery  # noqa: E402
bench_app.command("throughput")(throughput)
bench_app.command("protect")(protect)
bench_app.command("recovery")(recovery)
from unbroken.bench.detect import detect as detect_bench  # noqa: E402
bench_app.command("detect")(detect_bench)


def fail(message: str) -> None:
    """Print a one-line error and exit 2 (no traceback)."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


from unbroken.runtime.command import demo, run  # noqa: E402

app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(run)
app.command("demo")(demo)

# --- subcommands owned by subpackages (each registers itself below) ---
from unbroken.sim.command import simulate  # noqa: E402
app.command("simulate")(simulate)
from unbroken.detect.command import report  # noqa: E402
app.command("report")(report)


def main() -> None:
    try:
        app()
    except ConfigError as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        sys.exit(2)


if __name__ == "__main__":
    main()
