"""`unbroken predict`: power, ITL, tokens/s and tokens/J of a model on a GPU, with 90% intervals.

    unbroken predict --gpu "H100 SXM" --model meta-llama/Meta-Llama-3.1-8B --batch 32 [--tp 1]
    unbroken predict --model meta-llama/Meta-Llama-3.1-8B --rank [--prices prices.csv]
    unbroken predict --check measured.jsonl          (predict your own measurements, compare)
    unbroken predict profile --gpu NAME --out DIR    (measure a model served here, same schema)

The regressors train on the shipped public measurements (plus --measurements FILE) at each call.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table as RichTable

from unbroken.cli_error import fail
from unbroken.provenance import git_commit
from unbroken.predict import measurements, service
from unbroken.predict.features import SCENARIOS, OperatingPoint, point_of
from unbroken.predict.profile import profile
from unbroken.predict.tables import SpecError, load_gpus, load_models

predict_app = typer.Typer(invoke_without_command=True, no_args_is_help=False,
                          help="Predict inference power and latency on GPUs and models nobody profiled.")
predict_app.command("profile")(profile)


def _prices(path: Path, gpus) -> dict[str, float]:
    """A CSV with columns gpu,usd_per_hour (per GPU); names are looked up like --gpu."""
    if not path.is_file():
        fail(f"--prices {path}: no such file; give a CSV with columns gpu,usd_per_hour")
    out = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if "gpu" not in r or "usd_per_hour" not in r:
                fail(f"--prices {path}: needs the columns gpu,usd_per_hour")
            try:
                price = float(r["usd_per_hour"])
            except ValueError:
                fail(f"--prices {path}: usd_per_hour {r['usd_per_hour']!r} for {r['gpu']!r} is not a number")
            if not price > 0:
                fail(f"--prices {path}: usd_per_hour for {r['gpu']!r} must be > 0, got {price}")
            out[gpus.get(r["gpu"]).name] = price
    return out


def _fmt(v: tuple[float, float, float], digits: int = 3) -> str:
    return f"{v[0]:.{digits}g} [{v[1]:.{digits}g}, {v[2]:.{digits}g}]"


def _table(estimates: list, title: str, with_cost: bool) -> RichTable:
    t = RichTable(title=title, caption="measured: ITL rows of that GPU in the training data (its intervals are "
                                       "calibrated for 1, 5, 20 or 100 rows, the most it has); none: never measured, "
                                       "a rough guess; via X: its ITL is measured GPU X's (same manufacturer) "
                                       "scaled by their rooflines, and by its own level where its rows give one")
    cols = ["GPU", "measured", "GPUs", "power/GPU W", "ITL ms", "tokens/s", "tokens/J"] + \
        (["$/Mtok"] if with_cost else [])
    for c in cols:
        t.add_column(c)
    for e in estimates:
        itl_ms = tuple(x * 1e3 for x in e.itl_s)
        seen = (str(e.gpu_rows) if e.gpu_rows else "none") + (f", via {e.itl_sibling}" if e.itl_sibling else "")
        row = [e.gpu, seen, str(e.n_gpus), _fmt(e.power_w), _fmt(itl_ms),
               _fmt(e.tokens_s), _fmt(e.tokens_per_j)]
        if with_cost:
            row.append(_fmt(e.usd_per_mtok))
        t.add_row(*row)
    return t


def _check(path: Path, trained, gpus, models, as_json: bool) -> None:
    result = service.check(trained, gpus, models, measurements.load_user(path))
    if as_json:
        print(json.dumps({"measurements": str(path), **git_commit(), **result}, indent=2))
        return
    for r in result["rows"]:
        typer.echo(f"{r['gpu']} {r['model']} batch {r['batch']:g}: {r['target']} measured {r['measured']:.4g}, "
                   f"predicted {_fmt((r['predicted'], r['low'], r['high']))} ({r['error'] * 100:+.1f}%, "
                   f"{'inside' if r['inside'] else 'outside'} the interval)")
    for target, s in result["summary"].items():
        typer.echo(f"{target}: MdAPE {s['mdape']:.1f}% over {s['n']} rows, {s['coverage']:.0%} inside the interval")


@predict_app.callback()
def predict(ctx: typer.Context,
            gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU name as in the spec tables (e.g. 'H100 SXM')"),
            model: Optional[str] = typer.Option(None, "--model", help="Hugging Face model id"),
            batch: float = typer.Option(32, "--batch", help="concurrent requests"),
            tp: int = typer.Option(1, "--tp", help="GPUs serving one replica (tensor x pipeline parallel)"),
            scenario: str = typer.Option("server", "--scenario", help=f"one of {', '.join(SCENARIOS)}"),
            framework: str = typer.Option("vLLM", "--framework", help="serving framework (vLLM, TensorRT-LLM, ...)"),
            prompt_tokens: Optional[float] = typer.Option(None, "--prompt-tokens", help="mean prompt length "
                                                          "(default: unknown; the trees then take their missing-value path)"),
            output_tokens: Optional[float] = typer.Option(None, "--output-tokens", help="mean output length"),
            rank: bool = typer.Option(False, "--rank", help="rank every GPU in the tables for --model"),
            prices: Optional[Path] = typer.Option(None, "--prices", help="CSV gpu,usd_per_hour: rank by cost"),
            gpu_specs: list[Path] = typer.Option([], "--gpu-specs", help="extra GPU rows (gpu_specs_extra.csv format)"),
            model_specs: list[Path] = typer.Option([], "--model-specs", help="extra model rows"),
            measurement_files: list[Path] = typer.Option([], "--measurements", help="your JSONL measurements to train on"),
            check: Optional[Path] = typer.Option(None, "--check", help="JSONL measurements to predict and compare"),
            as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Predict power/GPU, ITL, tokens/s and tokens/J with 90% intervals (or rank the GPUs)."""
    if ctx.invoked_subcommand is not None:
        return
    if check is None and model is None:
        fail("give --model (and --gpu, or --rank), or --check FILE; see `unbroken predict --help`")
    if check is None and not rank and gpu is None:
        fail("give --gpu NAME for one prediction, or --rank to rank every GPU in the tables")
    for p in (*measurement_files, *([check] if check else [])):
        if not p.is_file():
            fail(f"{p}: no such file; record measurements with `unbroken predict profile`")
    try:
        op = OperatingPoint(n_gpus=tp, batch=batch, scenario=scenario, framework=framework,
                            prompt_tokens=math.nan if prompt_tokens is None else prompt_tokens,
                            output_tokens=math.nan if output_tokens is None else output_tokens)
        gpus, models = load_gpus(tuple(gpu_specs)), load_models(tuple(model_specs))
        spec = models.get(model) if model else None
        gspec = gpus.get(gpu) if gpu else None
        price_map = _prices(prices, gpus) if prices else None
        extra = [m for p in measurement_files for m in measurements.load_user(p)]
        console = Console(stderr=as_json)
        console.print("[dim]training on the public measurements (cached after the first run) ...[/]")
        trained = service.train_cached(service.training_table(gpus, models, extra))
        if check is not None:
            _check(check, trained, gpus, models, as_json)
            return
        if rank:
            est = service.rank(trained, gpus, spec, op, price_map)
            if as_json:
                print(json.dumps([service.as_dict(e) for e in est], indent=2))
            else:
                by = "cost ($ per million output tokens)" if price_map else "tokens/J"
                console.print(_table(est, f"{spec.name}, batch {batch:g}, {tp} GPU(s): ranked by {by}", bool(price_map)))
            return
        usd = price_map.get(gspec.name) if price_map else None
        e = service.estimate(trained, gspec, spec, op, usd)
    except (SpecError, ValueError) as err:
        fail(str(err))
    if as_json:
        print(json.dumps({**service.as_dict(e), **git_commit()}, indent=2))
        return
    console.print(_table([e], f"{spec.name} on {gspec.name}, batch {batch:g} (90% intervals)", usd is not None))
    if spec.name != model:
        console.print(f"[dim]model specs: {spec.name} (same architecture as {model})[/]")
    if e.lengths_ignored:
        console.print(f"[dim]{' and '.join(n.replace('_', ' ') for n in e.lengths_ignored)} read as unknown: no "
                      f"training row of {op.framework} in the {op.scenario} scenario recorded it[/]")
