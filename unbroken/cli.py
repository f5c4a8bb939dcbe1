"""The `unbroken` command line: run, demo, report, simulate, plan, bench, store.

Each subpackage owns its command module; this file only assembles them. User mistakes
print one line naming the problem and the fix and exit with status 2.
"""
from __future__ import annotations

import sys

from unbroken.runtime import prestart

if __name__ == "__main__" or sys.argv[0].endswith("/unbroken"):
    prestart.early(sys.argv)  # `run`: the fork server imports torch while the imports below do

import typer  # noqa: E402 - after the fork server's start, on purpose

from unbroken.bench.adoption import adoption
from unbroken.bench.chaos import chaos
from unbroken.bench.command import (collectives as collectives_bench, interval, multinode, overhead,
                                    overlap as overlap_bench, plan as plan_bench,
                                    protect, recovery, regroup, strategies as strategies_bench, throughput)
from unbroken.bench.detect import detect as detect_bench
from unbroken.bench.serve import serve as serve_bench
from unbroken.bench.predict import predict as predict_bench
from unbroken.config import ConfigError
from unbroken.detect.command import report
from unbroken.plan.command import choose_for_run, plan
from unbroken.predict.command import predict_app
from unbroken.runtime.command import demo, run, set_auto_strategy
from unbroken.runtime.export import export
from unbroken.runtime.store_command import store_app
from unbroken.serve.command import serve_app
from unbroken.sim.command import simulate
from unbroken.rl.command import register as register_rl
from unbroken.split.command import register as register_split

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Keep PyTorch training productive while hardware fails.")
app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(run)
app.command("demo")(demo)
app.command("report")(report)
app.command("export")(export)
app.command("simulate")(simulate)
app.command("chaos")(chaos)
app.command("plan")(plan)
app.add_typer(serve_app, name="serve")
app.add_typer(store_app, name="store")
app.add_typer(predict_app, name="predict")
set_auto_strategy(choose_for_run)  # the runtime may not import the planner (a tool): cli.py plugs it in

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: print ratios side by side, write bench/results/*.json.")
app.add_typer(bench_app, name="bench")
bench_app.command("throughput")(throughput)
bench_app.command("protect")(protect)
bench_app.command("recovery")(recovery)
bench_app.command("detect")(detect_bench)
bench_app.command("overhead")(overhead)
bench_app.command("interval")(interval)
bench_app.command("adoption")(adoption)
bench_app.command("plan")(plan_bench)
bench_app.command("strategies")(strategies_bench)
bench_app.command("multinode")(multinode)
bench_app.command("regroup")(regroup)
bench_app.command("collectives")(collectives_bench)
bench_app.command("overlap")(overlap_bench)
register_split(app, bench_app)
register_rl(app, bench_app)
bench_app.command("serve")(serve_bench)
bench_app.command("predict")(predict_bench)


def main() -> None:
    try:
        app()
    except ConfigError as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        sys.exit(2)  # outside typer's app(): cli_error.fail's typer.Exit would not be caught here


if __name__ == "__main__":
    main()
