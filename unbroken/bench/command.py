"""`unbroken bench throughput|protect|recovery`: run one benchmark, print its table, save JSON (+PNG)."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from unbroken.bench.common import RESULTS_DIR, write_result

_OUT = typer.Option(RESULTS_DIR, "--out", help="directory for NAME.json (and NAME.png)")
_QUICK = typer.Option(False, "--quick", help="smoke run: fewer steps and repeats")


def _finish(name: str, res: dict, table, out: Path) -> None:
    console = Console()
    console.print(table(res))
    path = write_result(name, res, out)
    console.print(f"wrote {path}")


def throughput(quick: bool = _QUICK, out: Path = _OUT,
               steps: int = typer.Option(0, "--steps", help="steps per run (default 20, quick 6)")) -> None:
    """Tokens/s at 1, 2 and 4 ranks, with a plain torchrun + DDP run of the same job beside each."""
    from unbroken.bench import throughput as tp

    if steps < 0:
        raise typer.BadParameter(f"--steps must be >= 0 (0 = default), got {steps}")
    res = tp.measure(steps=steps or (6 if quick else 20))
    _finish("throughput", res, tp.table, out)


def protect(quick: bool = _QUICK, out: Path = _OUT) -> None:
    """Parity encode vs memcpy, per-step overhead of tier 1 (and tier 2), rebuild time, memory overhead."""
    from unbroken.bench import protect as pr

    res = pr.measure(quick=quick)
    _finish("protect", res, pr.table, out)


def recovery(quick: bool = _QUICK, out: Path = _OUT) -> None:
    """torchrun restart-all + Young/Daly checkpoints vs unbroken in place, same job and SIGKILL schedule."""
    from unbroken.bench import recovery as rc

    res = rc.measure(quick=quick, plot_path=Path(out) / "recovery.png")
    _finish("recovery", res, rc.table, out)
