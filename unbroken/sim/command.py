"""`unbroken simulate`: options -> simulation -> table or JSON lines, the ETTR-vs-size PNG, optional events.

User mistakes print one `error: ...` line to stderr and exit 2 (the cli.fail convention).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from unbroken.cli_error import fail
from unbroken.sim.calibrate import calibrate as apply_calibration
from unbroken.sim.calibrate import load_calibration
from unbroken.sim.cluster import Cluster
from unbroken.sim.costs import Workload
from unbroken.sim.engine import run_policy
from unbroken.sim.errors import SimError, need
from unbroken.sim.eventlog import run_events, write_events
from unbroken.sim.montecarlo import monte_carlo, sweep
from unbroken.sim.policies import (Policy, ReplicaHeal, Unbroken, apply_settings, make_policy,
                                   parse_policies)
from unbroken.sim.rates import FailureMix, default_mix, load_mix
from unbroken.sim.report import json_lines, print_table

DEFAULT_PLOT = Path("bench/results/sim_ettr.png")
_W, _C, _R, _U = Workload(), Cluster(gpus=8), ReplicaHeal(), Unbroken()


@dataclass(frozen=True)
class _Setup:
    mix: FailureMix
    cluster: Cluster
    workload: Workload
    policies: dict[str, Policy]


def _say(msg: str) -> None:
    typer.echo(msg, err=True)




def _given(**kw: Any) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


def _setup(opts: dict[str, Any]) -> _Setup:
    mix = default_mix() if opts["rates"] is None else load_mix(opts["rates"])
    cluster = Cluster(gpus=opts["gpus"], node_size=opts["node_size"], days=opts["days"],
                      **_given(spares=opts["spares"], repair_h=opts["repair_h"], provision_s=opts["provision_s"]))
    workload = Workload(**_given(step_s=opts["step_s"], state_gb=opts["state_gb"],
                                 storage_gbps=opts["storage_gbps"], net_gbps=opts["net_gbps"],
                                 overlap=opts["overlap"]))
    params = dict(interval_s=opts["ckpt_interval_s"], save_s=opts["ckpt_save_s"],
                  tier2_interval_s=opts["tier2_interval_s"], replicas=opts["replicas"],
                  parity_group=opts["parity_group"], protect_every=opts["protect_every"],
                  every_steps=opts["protect_every"], bench_gbps=opts["bench_gbps"])
    policies = {n: make_policy(n, **params) for n in parse_policies(opts["policy"])}
    policies = apply_settings(policies, opts["set"] or [])
    if opts["calibrate"] is not None:
        cal = load_calibration(opts["calibrate"])
        for note in cal.notes:
            _say(f"calibration: {note}")
        policies = {n: apply_calibration(p, cal) for n, p in policies.items()}
    return _Setup(mix=mix, cluster=cluster, workload=workload, policies=policies)


def _title(s: _Setup, seeds: int, seed: int) -> str:
    src = s.mix.source.split(":")[0] if s.mix.source else "custom rates"
    return (f"{s.cluster.gpus:,} GPUs x {s.cluster.days:g} days, seeds {seed}..{seed + seeds - 1}, "
            f"MTTF {s.mix.mttf_hours(s.cluster.gpus):.3g} h ({src})")


def _write_events(s: _Setup, path: Path, seed: int, limit: int) -> None:
    need(len(s.policies) == 1, "--events writes one run of one policy; add e.g. --policy unbroken")
    need(limit >= 3, f"--events-limit must be >= 3, got {limit}")
    ((name, pol),) = s.policies.items()
    run = run_policy(pol, s.cluster, s.mix, s.workload, seed, record=True)
    events = run_events(run, s.mix, s.cluster, limit=limit)
    try:
        write_events(path, events)
    except OSError as e:
        raise SimError(f"cannot write events to {str(path)!r}: {e.strerror or e}") from None
    _say(f"wrote {len(events)} events of {name} (seed {seed}) to {path}")


def _timing(s: _Setup, seed: int) -> None:
    for name, pol in s.policies.items():
        t0 = time.perf_counter()
        run_policy(pol, s.cluster, s.mix, s.workload, seed)
        _say(f"timing: {name}, one seed, {s.cluster.gpus:,} GPUs x {s.cluster.days:g} days: "
             f"{time.perf_counter() - t0:.3f} s")


def _plot(s: _Setup, path: Path, seeds: int, seed: int) -> None:
    from unbroken.sim.plot import plot_ettr  # matplotlib only when a figure is wanted

    curves = sweep(s.policies, s.cluster, s.mix, s.workload, seeds=seeds, seed=seed)
    try:
        plot_ettr(curves, path, title=f"ETTR vs cluster size, {s.cluster.days:g} days, {seeds} seeds")
    except OSError as e:
        raise SimError(f"cannot write the plot to {str(path)!r}: {e.strerror or e}; pass --plot PATH "
                       "or --no-plot") from None
    _say(f"wrote {path}")


def _main(opts: dict[str, Any]) -> None:
    s = _setup(opts)
    seeds, seed = opts["seeds"], opts["seed"]
    summaries = monte_carlo(s.policies, s.cluster, s.mix, s.workload, seeds=seeds, seed=seed)
    if opts["json"]:
        sys.stdout.write(json_lines(summaries))
        sys.stdout.flush()
    else:
        print_table(summaries, _title(s, seeds, seed))
    if opts["events"] is not None:
        _write_events(s, opts["events"], seed, opts["events_limit"])
    if opts["timing"]:
        _timing(s, seed)
    if not opts["no_plot"]:
        _plot(s, opts["plot"], seeds, seed)


Opt = typer.Option


def simulate(
    gpus: Annotated[int, Opt(help="GPUs in the job.")] = 131072,
    days: Annotated[float, Opt(help="Simulated wall-clock days.")] = 30.0,
    policy: Annotated[str, Opt(help="ckpt-restart, in-memory, replica-heal, unbroken, a comma list, or all.")] = "all",
    node_size: Annotated[int, Opt(help="GPUs per node; must divide --gpus.")] = 8,
    seeds: Annotated[int, Opt(help="Monte-Carlo runs (seeds --seed, --seed+1, ...).")] = 10,
    seed: Annotated[int, Opt(help="First seed; the run is a function of (seed, gpus).")] = 0,
    rates: Annotated[Optional[Path], Opt(help="Failure-rate JSON (default: the Llama 3 405B mix).")] = None,
    calibrate: Annotated[Optional[Path], Opt(help="Recovery benchmark JSON (bench/results/recovery.json).")] = None,
    json_out: Annotated[bool, Opt("--json", help="Print one JSON object per policy instead of a table.")] = False,
    plot: Annotated[Path, Opt(help="Where to write the ETTR-vs-size PNG.")] = DEFAULT_PLOT,
    no_plot: Annotated[bool, Opt("--no-plot", help="Skip the size sweep and the PNG.")] = False,
    events: Annotated[Optional[Path], Opt(help="Write one run (single policy, --seed) as events.jsonl.")] = None,
    events_limit: Annotated[int, Opt(help="At most this many events in --events.")] = 50000,
    timing: Annotated[bool, Opt("--timing", help="Print how long one seed of each policy takes.")] = False,
    step_s: Annotated[Optional[float], Opt(help=f"Seconds per training step [{_W.step_s:g}].")] = None,
    state_gb: Annotated[Optional[float], Opt(help=f"Per-GPU weights+optimizer GB [{_W.state_gb:g}].")] = None,
    storage_gbps: Annotated[Optional[float], Opt(help=f"Per-GPU storage GB/s [{_W.storage_gbps:g}].")] = None,
    net_gbps: Annotated[Optional[float], Opt(help=f"Per-GPU recovery network GB/s [{_W.net_gbps:g}].")] = None,
    overlap: Annotated[Optional[float], Opt(help=f"Share of background copies hidden [{_W.overlap:g}].")] = None,
    spares: Annotated[Optional[int], Opt(help="Hot spare nodes [1% of nodes, at least 2].")] = None,
    repair_h: Annotated[Optional[float], Opt(help=f"Hours until a replaced node is back [{_C.repair_h:g}].")] = None,
    provision_s: Annotated[Optional[float], Opt(help=f"Wait for a node when no spare is free "
                                                     f"[{_C.provision_s:g}].")] = None,
    ckpt_interval_s: Annotated[Optional[float], Opt(help="ckpt-restart compute s between checkpoints "
                                                         "[Young/Daly optimum].")] = None,
    ckpt_save_s: Annotated[Optional[float], Opt(help="ckpt-restart blocking save s "
                                                    "(default: state-gb / storage-gbps).")] = None,
    tier2_interval_s: Annotated[Optional[float], Opt(help="Persistent checkpoint interval of the other "
                                                          "policies [Young/Daly for tier-2 faults].")] = None,
    replicas: Annotated[Optional[int], Opt(help=f"replica-heal replica groups [{_R.replicas}].")] = None,
    parity_group: Annotated[Optional[int], Opt(help=f"unbroken parity group, nodes [{_U.parity_group}].")] = None,
    protect_every: Annotated[Optional[int], Opt(help=f"Steps between parity/in-memory copies "
                                                    f"[{_U.protect_every}].")] = None,
    bench_gbps: Annotated[Optional[float], Opt(help=f"Link GB/s of the calibration bench [{_U.bench_gbps:g}].")] = None,
    set_: Annotated[Optional[list[str]], Opt("--set", help="POLICY.FIELD=VALUE for any policy parameter, "
                                                          "e.g. unbroken.detect_s=5 (repeatable).")] = None,
) -> None:
    """Simulate failures and recovery on a cluster; print ETTR per policy and plot ETTR vs size."""
    opts = dict(locals())
    opts["json"], opts["set"] = opts.pop("json_out"), opts.pop("set_")
    try:
        _main(opts)
    except SimError as e:
        fail(str(e))

