"""`unbroken report RUN_DIR...`: print the operational report, write timeline.png and report.md."""
from __future__ import annotations

import json as _json
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer

from unbroken.cli_error import fail
from unbroken.detect.report import analyze, load_runs
from unbroken.detect.summary import print_rich, to_markdown




def _replace(tmp: Path, final: Path) -> None:
    # Readers never see a half-written file: fsync the temp file, then rename over the old one.
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def report(
    run_dirs: Annotated[list[Path], typer.Argument(
        help="Run directories holding events.jsonl (real or simulated); several are combined.",
        metavar="RUN_DIR...", show_default=False)],
    json: Annotated[bool, typer.Option(
        "--json", help="Print exactly one JSON object (ettr, faults, false_positives, offenders, ...).")] = False,
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Where to write timeline.png and report.md (default: the first RUN_DIR).")] = None,
) -> None:
    """Faults by class, detection latency, detect/diagnose/recover split, ETTR, false positives, offenders."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            runs = load_runs(run_dirs)
        except FileNotFoundError as e:
            fail(str(e))
        except OSError as e:
            fail(f"cannot read events: {e}")
    for w in caught:
        typer.secho(f"warning: {w.message}", err=True, fg=typer.colors.YELLOW)
    if not any(r.events for r in runs):
        fail(f"no readable events in {', '.join(map(str, run_dirs))}; nothing to report")
    result = analyze(runs)
    result["skipped_lines"] = sum(1 for w in caught if "malformed event line" in str(w.message))
    dest = out or (run_dirs[0] if run_dirs[0].is_dir() else run_dirs[0].parent)
    from unbroken.detect.timeline import draw_timeline  # matplotlib: loaded only when drawing

    try:
        dest.mkdir(parents=True, exist_ok=True)
        _replace(draw_timeline(runs, result, dest / ".timeline.png.tmp.png"), dest / "timeline.png")
        tmp = dest / ".report.md.tmp"
        tmp.write_text(to_markdown(result))
        _replace(tmp, dest / "report.md")
    except OSError as e:
        fail(f"cannot write the report into {dest}: {e.strerror or e}; pass --out DIR")
    if json:
        sys.stdout.write(_json.dumps(result) + "\n")
        return
    print_rich(result)
    typer.echo(f"wrote {dest / 'timeline.png'} and {dest / 'report.md'}")
