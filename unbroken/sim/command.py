"""`unbroken simulate`: options -> simulation -> table or JSON lines, the ETTR-vs-size PNG, optional events.

ETTR is net of each policy's failure-free overhead; unbroken's comes from --overhead, else
--calibrate (overhead.json), else the uncalibrated default, and the JSON says which.
`--sizes`, `--break-even` and `--out` give the per-size net table of docs/simulator.md.
User mistakes print one `error: ...` line to stderr and exit 2 (the cli.fail convention).
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from unbroken.cli_error import fail
from unbroken.sim.calibrate import Calibrations, load_calibrations
from unbroken.sim.calibrate import calibrate as apply_calibration
from unbroken.sim.cluster import Cluster
from unbroken.sim.costs import Workload
from unbroken.sim.engine import run_policy
from unbroken.sim.errors import SimError, need
from unbroken.sim.eventlog import run_events, write_events
from unbroken.sim.montecarlo import Summary, monte_carlo, sweep
from unbroken.sim.regroup_fit import apply_regroup_fit
from unbroken.sim.net import break_even_row, describe, overhead_grid, unbroken_ettr_at, write_document
from unbroken.sim.policies import (OVERHEAD_SOURCES, Policy, ReplicaHeal, Unbroken, apply_settings, check_overhead,
                                   make_policy, parse_policies)
from unbroken.sim.rates import FailureMix, default_mix, load_mix
from unbroken.sim.report import json_lines, print_table

DEFAULT_PLOT = Path("bench/results/sim_ettr.png")
_W, _C, _R, _U = Workload(), Cluster(gpus=8), ReplicaHeal(), Unbroken()


@dataclass(frozen=True)
class _Setup:
    mix: FailureMix
    cluster: Cluster  # the largest size: events, timing and the plot use it
    workload: Workload
    policies: dict[str, Policy]
    sizes: tuple[int, ...] = ()
    overhead_source: dict[str, dict[str, Any]] = field(default_factory=dict)
    uncalibrated_note: str | None = None


def _say(msg: str) -> None:
    typer.echo(msg, err=True)


def _given(**kw: Any) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


def _sizes(spec: str | None, gpus: int) -> tuple[int, ...]:
    if spec is None:
        return (gpus,)
    try:
        sizes = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise SimError(f"--sizes {spec!r}: expected GPU counts separated by commas, e.g. 1024,16384,131072") from None
    need(bool(sizes) and all(g >= 1 for g in sizes),
         f"--sizes {spec!r}: expected GPU counts >= 1 separated by commas, e.g. 1024,16384,131072")
    return tuple(sorted(set(sizes)))


def _default_sources(names: list[str]) -> dict[str, dict[str, Any]]:
    kind = {"ckpt-restart": "simulated saves", "in-memory": "published", "replica-heal": "modelling choice",
            "unbroken": "uncalibrated"}
    return {n: {"kind": kind[n], "source": OVERHEAD_SOURCES[n]} for n in names}


def _calibrate(policies: dict[str, Policy], cal: Calibrations, sources: dict[str, dict[str, Any]]) -> dict[str, Policy]:
    for note in cal.notes:
        _say(f"calibration: {note}")
    if cal.recovery is not None:
        policies = {n: apply_calibration(p, cal.recovery) for n, p in policies.items()}
    if cal.regroup is not None and "unbroken" in policies:  # the fitted curve wins over the breakdown's log2 scaling
        policies["unbroken"] = apply_regroup_fit(policies["unbroken"], cal.regroup)
        _say(f"calibration: unbroken's regroup from {cal.regroup.source}: {cal.regroup.a_s:.3f} s + "
             f"{cal.regroup.b_s:.4f} s x {'log2 N' if cal.regroup.model == 'log2' else 'N'}")
    if cal.overhead is not None and "unbroken" in policies:
        policies["unbroken"] = dataclasses.replace(policies["unbroken"], overhead=cal.overhead.overhead)
        sources["unbroken"] = cal.overhead.provenance()
    return policies


def _uncalibrated_note(u: Policy, cal: Calibrations | None) -> str:
    why = "no --calibrate" if cal is None else cal.overhead_missing
    return (f"note: unbroken's failure-free overhead is uncalibrated ({u.overhead:g}, the cost measured on main "
            f"before amortized protection; {why}): run `unbroken bench overhead`, then --calibrate bench/results, "
            "or pass --overhead F")


def _policies(opts: dict[str, Any]) -> tuple[dict[str, Policy], dict[str, dict[str, Any]], str | None]:
    """Defaults -> --calibrate -> --set -> --overhead (explicit values win over measured ones)."""
    params = dict(interval_s=opts["ckpt_interval_s"], save_s=opts["ckpt_save_s"],
                  tier2_interval_s=opts["tier2_interval_s"], replicas=opts["replicas"],
                  parity_group=opts["parity_group"], protect_every=opts["protect_every"],
                  every_steps=opts["protect_every"], bench_gbps=opts["bench_gbps"])
    names = parse_policies(opts["policy"])
    policies = {n: make_policy(n, **params) for n in names}
    sources = _default_sources(names)
    cal = None if not opts["calibrate"] else load_calibrations(opts["calibrate"])
    if cal is not None:
        policies = _calibrate(policies, cal, sources)
    policies = apply_settings(policies, opts["set"] or [])
    for item in opts["set"] or []:
        name = item.partition("=")[0].strip()
        if name.endswith(".overhead") and name[: -len(".overhead")] in sources:
            sources[name[: -len(".overhead")]] = {"kind": "set", "source": f"--set {item}"}
    if opts["overhead"] is not None:
        check_overhead("--overhead", opts["overhead"])
        if "unbroken" in policies:
            policies["unbroken"] = dataclasses.replace(policies["unbroken"], overhead=opts["overhead"])
            sources["unbroken"] = {"kind": "cli", "source": f"--overhead {opts['overhead']:g}"}
    note = None
    if "unbroken" in policies and sources["unbroken"]["kind"] == "uncalibrated":
        note = _uncalibrated_note(policies["unbroken"], cal)
    return policies, sources, note


def _setup(opts: dict[str, Any]) -> _Setup:
    mix = default_mix() if opts["rates"] is None else load_mix(opts["rates"])
    sizes = _sizes(opts["sizes"], opts["gpus"])
    cluster = Cluster(gpus=sizes[-1], node_size=opts["node_size"], days=opts["days"],
                      **_given(spares=opts["spares"], repair_h=opts["repair_h"], provision_s=opts["provision_s"]))
    for g in sizes:
        dataclasses.replace(cluster, gpus=g)  # validates every size (node size divides it, ...)
    workload = Workload(**_given(step_s=opts["step_s"], state_gb=opts["state_gb"],
                                 storage_gbps=opts["storage_gbps"], net_gbps=opts["net_gbps"],
                                 overlap=opts["overlap"]))
    policies, sources, note = _policies(opts)
    return _Setup(mix=mix, cluster=cluster, workload=workload, policies=policies, sizes=sizes,
                  overhead_source=sources, uncalibrated_note=note)


def _title(s: _Setup, cluster: Cluster, seeds: int, seed: int) -> str:
    src = s.mix.source.split(":")[0] if s.mix.source else "custom rates"
    return (f"{cluster.gpus:,} GPUs x {cluster.days:g} days, seeds {seed}..{seed + seeds - 1}, "
            f"MTTF {s.mix.mttf_hours(cluster.gpus):.3g} h ({src}); ETTR net of each policy's overhead")


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
        plot_ettr(curves, path, title=f"net ETTR vs cluster size, {s.cluster.days:g} days, {seeds} seeds")
    except OSError as e:
        raise SimError(f"cannot write the plot to {str(path)!r}: {e.strerror or e}; pass --plot PATH "
                       "or --no-plot") from None
    _say(f"wrote {path}")


@dataclass
class _AtSize:
    gpus: int
    summaries: list[Summary]
    break_even: dict[str, Any] | None = None
    grid: dict[str, float] | None = None


def _simulate(s: _Setup, opts: dict[str, Any]) -> list[_AtSize]:
    seeds, seed = opts["seeds"], opts["seed"]
    out = []
    for g in s.sizes:
        at = dataclasses.replace(s.cluster, gpus=g)
        r = _AtSize(g, monte_carlo(s.policies, at, s.mix, s.workload, seeds=seeds, seed=seed))
        if opts["break_even"]:
            ettr_at = unbroken_ettr_at(s.policies.get("unbroken"), at, s.mix, s.workload, seeds=seeds, seed=seed)
            r.break_even = break_even_row(r.summaries, ettr_at)
            r.grid = overhead_grid(ettr_at) if opts["out"] is not None else None
        out.append(r)
    return out


def _extra(s: _Setup, r: _AtSize) -> dict[str, dict[str, Any]]:
    extra: dict[str, dict[str, Any]] = {n: {"overhead_source": src} for n, src in s.overhead_source.items()}
    if r.break_even is not None:
        extra["unbroken"]["break_even_overhead"] = r.break_even
    return extra


def _document(s: _Setup, opts: dict[str, Any], results: list[_AtSize]) -> dict[str, Any]:
    keep = ("policy", "days", "seeds", "seed", "node_size", "rates", "calibrate", "overhead", "set", "step_s",
            "state_gb", "storage_gbps", "net_gbps", "overlap", "spares")
    return {"generated_by": "unbroken simulate", "options": {k: opts[k] for k in keep},
            "ettr": "net: productive / wall, productive = kept compute / (1 + overhead)",
            "overhead": {n: {"value": p.overhead, **s.overhead_source[n]} for n, p in s.policies.items()},
            "sizes": [{"gpus": r.gpus, "mttf_h": round(s.mix.mttf_hours(r.gpus), 4),
                       "policies": {x.policy: x.to_json() for x in r.summaries},
                       "break_even_overhead": r.break_even, "unbroken_ettr_at_overhead": r.grid}
                      for r in results]}


def _main(opts: dict[str, Any]) -> None:
    s = _setup(opts)
    seeds, seed = opts["seeds"], opts["seed"]
    results = _simulate(s, opts)
    for r in results:
        if opts["json"]:
            sys.stdout.write(json_lines(r.summaries, _extra(s, r)))
            sys.stdout.flush()
        else:
            print_table(r.summaries, _title(s, dataclasses.replace(s.cluster, gpus=r.gpus), seeds, seed))
            if r.break_even is not None:
                typer.echo(describe(r.gpus, r.break_even))
    if opts["out"] is not None:
        write_document(opts["out"], _document(s, opts, results))
        _say(f"wrote {opts['out']}")
    if opts["events"] is not None:
        _write_events(s, opts["events"], seed, opts["events_limit"])
    if opts["timing"]:
        _timing(s, seed)
    if not opts["no_plot"]:
        _plot(s, opts["plot"], seeds, seed)
    if s.uncalibrated_note:
        _say(s.uncalibrated_note)


Opt = typer.Option


def simulate(
    gpus: Annotated[int, Opt(help="GPUs in the job.")] = 131072,
    days: Annotated[float, Opt(help="Simulated wall-clock days.")] = 30.0,
    policy: Annotated[str, Opt(help="ckpt-restart, in-memory, replica-heal, unbroken, a comma list, or all.")] = "all",
    node_size: Annotated[int, Opt(help="GPUs per node; must divide --gpus.")] = 8,
    seeds: Annotated[int, Opt(help="Monte-Carlo runs (seeds --seed, --seed+1, ...).")] = 10,
    seed: Annotated[int, Opt(help="First seed; the run is a function of (seed, gpus).")] = 0,
    rates: Annotated[Optional[Path], Opt(help="Failure-rate JSON (default: the Llama 3 405B mix).")] = None,
    calibrate: Annotated[Optional[list[Path]], Opt(help="Benchmark JSON (recovery.json, overhead.json) or a "
                                                        "directory holding them, e.g. bench/results "
                                                        "(repeatable).")] = None,
    overhead: Annotated[Optional[float], Opt(help="unbroken's failure-free overhead, a fraction of step time "
                                                  "(overrides --calibrate).")] = None,
    sizes: Annotated[Optional[str], Opt(help="Simulate these GPU counts instead of --gpus, "
                                             "e.g. 1024,16384,131072.")] = None,
    break_even: Annotated[bool, Opt("--break-even", help="Bisect the largest overhead at which unbroken still "
                                                         "beats ckpt-restart (and the best other policy).")] = False,
    out: Annotated[Optional[Path], Opt(help="Write all results as one JSON document (with the git commit).")] = None,
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

