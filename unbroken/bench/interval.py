"""`unbroken bench interval`: what the tier-1 parity interval K costs and what it buys, in one run.

Tier-1 parity is brought up to date every K steps (`RunConfig(protect_every=K)`); between
parity points each rank keeps a ring of K averaged gradients and a recovery decodes the
lost shard at the last parity point and replays the steps since. This module owns the
sweep over K that shows the trade, on the zero1 strategy:

    off      protection off (tier1=False, checkpoint_every=0): the failure-free baseline
    K        protect_every=K, no tier-2 checkpoints; once failure-free, once with a kill

Runs are interleaved round by round (off, K1 free, K1 killed, K2 free, K2 killed, ...) so
the shared machine's drift hits every variant alike. What it measures, per K:

- overhead = mean_step(K) / mean_step(off) - 1 over rank 0's steady steps. The MEAN, not
  the median: every K-th step carries the parity work. The window and the statistics are
  `unbroken.bench.overhead`'s: steps 1..SKIP_STEPS dropped, then a whole number of K-periods
  (`steady_window`), the same window for K and for off; means pooled per run
  (`pooled_mean`), and the 95% CI from its two-stage paired bootstrap (`bootstrap_ci`).
- recovery: one SIGKILL of rank KILL_RANK (the last rank when the world is smaller) in the
  backward pass of `kill_step(K)`: K//2 + 1 steps past a parity point, the same place in
  the window for every K, and at least KILL_MIN_STEP. recovery_s (kill -> first step done)
  is the median over rounds of the summary's first recovery; steps_replayed comes from the
  `recovered` event; `bitwise` says the killed run's final weights equal the failure-free
  run's of the same K and round (in every round).
- memory per rank, from the `parity_built` event: parity, snapshot and gradient-log bytes,
  each also as a fraction of the protected (optimizer shard) bytes.

Results: a rich table, `interval.json` (`interval_result` is its schema) and `interval.png`.
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

import typer
from rich.console import Console, Group
from rich.table import Table

from unbroken.bench.common import RESULTS_DIR, SKIP_STEPS, fmt, job_events, run_job, step_events, write_result
from unbroken.bench.overhead import bootstrap_ci, in_window, mean_ratio, pooled_mean, steady_window
from unbroken.config import RunConfig
from unbroken.runtime.faults import FaultSpec

DEFAULT_KS = (1, 2, 4, 8, 16)
STRATEGY = "zero1"
KILL_RANK = 2
KILL_PHASE = "backward"
KILL_MIN_STEP = 10
MEMORY_PARTS = {"parity": "bytes", "snapshot": "snapshot_bytes", "gradient_log": "gradient_log_bytes"}
PHASES = ("detect", "decide", "regroup", "rebuild", "redo")


# --- the plan -----------------------------------------------------------------------------------
def kill_step(k: int, *, min_step: int = KILL_MIN_STEP) -> int:
    """The step whose backward pass is killed for interval k: parity point + k//2 + 1, >= min_step.

    Parity points are the multiples of k (step 0 is the initial build), so the kill lands at
    the same relative place of a k-window for every k and the recovery replays k//2 steps.
    """
    if k < 1:
        raise ValueError(f"the parity interval must be >= 1, got {k}")
    offset = k // 2 + 1
    windows = max(0, -(-(min_step - offset) // k))  # ceil: the first parity point with point + offset >= min_step
    return windows * k + offset


def kill_rank(world: int) -> int:
    """KILL_RANK, or the last rank of a smaller world."""
    return min(KILL_RANK, world - 1)


def kill_fault(k: int, world: int) -> FaultSpec:
    return FaultSpec.parse(f"sigkill:rank={kill_rank(world)},step={kill_step(k)},phase={KILL_PHASE}")


def variant_config(k: int | None, world: int, steps: int) -> RunConfig:
    """k=None: protection off; else tier-1 parity every k steps. zero1, no tier-2 checkpoints either way."""
    if k is None:
        return RunConfig(strategy=STRATEGY, world_size=world, steps=steps, tier1=False, checkpoint_every=0)
    return RunConfig(strategy=STRATEGY, world_size=world, steps=steps, protect_every=k, checkpoint_every=0)


def parse_ks(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, no duplicates); ValueError naming the option otherwise."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"--ks takes comma-separated integers >= 1, e.g. 1,2,4,8,16; got {text!r}")
    return sorted({int(p) for p in parts})


def validate(*, ks: list[int], world: int, steps: int, rounds: int) -> None:
    """Raise ValueError (ConfigError included) for settings that would fail only after some runs."""
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if not ks:
        raise ValueError("--ks needs at least one parity interval, e.g. --ks 1,4")
    if world < 2:
        raise ValueError(f"--world must be >= 2 (a killed rank needs a peer holding its parity), got {world}")
    steady_window(steps)
    need = kill_step(max(ks)) + 1
    if steps < need:
        raise ValueError(f"--steps {steps} is too short for K={max(ks)}, whose kill is at step "
                         f"{kill_step(max(ks))}; use --steps {need} or more")
    for k in (None, *ks):
        variant_config(k, world, steps)
    for k in ks:
        kill_fault(k, world)


# --- reading runs -------------------------------------------------------------------------------
def step_records(events: list) -> list[dict]:
    """Rank 0's steps in order, the last execution of each: {"step", "step_s", "parity"}."""
    by_step = {}
    for e in step_events(events):
        by_step[e.fields["step"]] = {"step": e.fields["step"], "step_s": float(e.fields["step_s"]),
                                     "parity": bool(e.fields.get("parity", False))}
    return [by_step[s] for s in sorted(by_step)]


def parity_built(events: list) -> dict | None:
    """Fields of rank 0's `parity_built` event (any rank's if rank 0 has none); None without tier 1."""
    built = [e for e in events if e.kind == "parity_built"]
    if not built:
        return None
    return dict(next((e for e in built if e.rank == 0), built[0]).fields)


def memory(fields: dict | None) -> dict | None:
    """Per-rank bytes of parity, snapshot and gradient log, and each as a fraction of the protected bytes."""
    if fields is None:
        return None
    protected = int(fields.get("protected_bytes") or 0)
    out = {part: int(fields.get(key) or 0) for part, key in MEMORY_PARTS.items()}
    fractions = {part: (b / protected if protected else None) for part, b in out.items()}
    fractions["total"] = sum(out.values()) / protected if protected else None
    return {**out, "protected": protected, "fractions": fractions}


def kill_sample(summary: dict, events: list, *, reference_sha: str | None, run_dir: Path) -> dict:
    """What one killed run shows: the first recovery's times, steps replayed, path, bitwise equality."""
    recs = [r for r in summary["recoveries"] if r.get("complete")]
    recovered = [e for e in events if e.kind == "recovered"]
    if not recs or not recovered:
        raise RuntimeError(f"the killed run recorded no complete recovery; see {run_dir}/events.jsonl")
    r = recs[0]
    sha = summary.get("weights_sha256")
    return {"recovery_s": r["recovery_s"], **{f"{p}_s": r.get(f"{p}_s") for p in PHASES},
            "steps_replayed": recovered[0].fields.get("steps_replayed"), "path": recovered[0].fields.get("path"),
            "recoveries": len(recs), "bitwise": bool(sha) and sha == reference_sha}


# --- the result ---------------------------------------------------------------------------------
def _times(runs: list[list[dict]], window: tuple[int, int]) -> list[list[float]]:
    return [[r["step_s"] for r in in_window(run, window)] for run in runs]


def overhead_of(free: dict, k: int, steps: int, skip: int = SKIP_STEPS) -> dict:
    """mean_step(k) / mean_step(off) - 1 with its paired bootstrap 95% CI, over k's steady window."""
    window = steady_window(steps, skip=skip, period=k)
    tk, to = _times(free[k], window), _times(free["off"], window)
    lo, hi = bootstrap_ci(tk, to)  # CI of pooled(tk) / pooled(to)
    return {"overhead": mean_ratio(tk, to) - 1, "ci95": [lo - 1, hi - 1], "window": list(window),
            "mean_step_s": pooled_mean(tk), "off_mean_step_s": pooled_mean(to),
            "parity_steps": sum(r["parity"] for r in in_window(free[k][0], window)), "samples": tk}


def _median_or_none(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def interval_result(samples: dict, *, ks: list[int], world: int, steps: int, rounds: int,
                    skip: int = SKIP_STEPS) -> dict:
    """The JSON schema of interval.json from raw samples (dict keys are str(K) there):

    samples = {"free": {"off": [records per round], K: [records per round]},
               "kill": {K: [kill_sample per round]}, "parity_built": {K: fields or None}}
    """
    ov = {k: overhead_of(samples["free"], k, steps, skip) for k in ks}
    kills = samples["kill"]

    def per_k(f):
        return {str(k): f(k) for k in ks}

    return {
        "ks": list(ks), "rounds": rounds, "world": world, "steps": steps, "strategy": STRATEGY,
        "skip_steps": skip, "off_step_s": pooled_mean(_times(samples["free"]["off"], steady_window(steps, skip=skip))),
        "overhead": per_k(lambda k: ov[k]["overhead"]), "overhead_ci95": per_k(lambda k: ov[k]["ci95"]),
        "mean_step_s": per_k(lambda k: ov[k]["mean_step_s"]),
        "off_mean_step_s": per_k(lambda k: ov[k]["off_mean_step_s"]),
        "window": per_k(lambda k: ov[k]["window"]), "parity_steps": per_k(lambda k: ov[k]["parity_steps"]),
        "recovery_s": per_k(lambda k: statistics.median(s["recovery_s"] for s in kills[k])),
        "recovery_breakdown_s": per_k(lambda k: {p: _median_or_none([s[f"{p}_s"] for s in kills[k]])
                                                 for p in PHASES}),
        "steps_replayed": per_k(lambda k: statistics.median_low(s["steps_replayed"] for s in kills[k])),
        "memory": per_k(lambda k: memory(samples["parity_built"].get(k))),
        "bitwise": per_k(lambda k: all(s["bitwise"] for s in kills[k])),
        "kill": {"rank": kill_rank(world), "phase": KILL_PHASE, "step": per_k(kill_step)},
        "bootstrap": {"method": "unbroken.bench.overhead.bootstrap_ci: two-stage paired, rounds then steps",
                      "level": 0.95},
        "samples": {"step_s": per_k(lambda k: ov[k]["samples"]), "kill": per_k(lambda k: list(kills[k]))},
    }


# --- running it ---------------------------------------------------------------------------------
def _keep(run_dir: Path, console: Console) -> Path:
    """Copy a failed run's directory out of the temporary root (which is deleted) and say where."""
    kept = Path(tempfile.mkdtemp(prefix=f"unbroken-bench-interval-failed-{run_dir.name}-"))
    shutil.copytree(run_dir, kept, dirs_exist_ok=True)
    console.log(f"interval: kept the failed run {run_dir.name} at {kept}")
    return kept


def _run(cfg: RunConfig, run_dir: Path, console: Console, faults: tuple = ()) -> tuple[dict, list]:
    try:
        s = run_job(cfg, run_dir, faults=faults, console=console)
    except Exception:
        if run_dir.is_dir():
            _keep(run_dir, console)
        raise
    if not s["ok"]:
        raise RuntimeError(f"interval run {run_dir.name} did not finish all {cfg.steps} steps; "
                           f"see {_keep(run_dir, console)}/events.jsonl")
    return s, job_events(run_dir)


def run_round(rnd: int, samples: dict, *, ks: list[int], world: int, steps: int, root: Path,
              console: Console) -> None:
    """One round, interleaved: off, then each K failure-free and with its kill; appends to samples."""
    _, events = _run(variant_config(None, world, steps), root / f"off-{rnd}", console)
    samples["free"]["off"].append(step_records(events))
    for k in ks:
        cfg = variant_config(k, world, steps)
        console.log(f"interval: round {rnd + 1}, K={k}, failure-free")
        free, events = _run(cfg, root / f"k{k}-free-{rnd}", console)
        samples["free"][k].append(step_records(events))
        samples["parity_built"].setdefault(k, parity_built(events))
        console.log(f"interval: round {rnd + 1}, K={k}, SIGKILL rank {kill_rank(world)} at step {kill_step(k)}")
        run_dir = root / f"k{k}-kill-{rnd}"
        killed, events = _run(cfg, run_dir, console, faults=(kill_fault(k, world),))
        samples["kill"][k].append(kill_sample(killed, events, reference_sha=free.get("weights_sha256"),
                                              run_dir=run_dir))


def measure(*, ks: list[int], world: int, steps: int, rounds: int, console: Console | None = None) -> dict:
    console = console or Console(stderr=True)
    validate(ks=ks, world=world, steps=steps, rounds=rounds)  # before the first run, not after the last
    samples: dict = {"free": {"off": [], **{k: [] for k in ks}}, "kill": {k: [] for k in ks}, "parity_built": {}}
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-interval-") as tmp:
        for rnd in range(rounds):
            console.log(f"interval: round {rnd + 1}/{rounds}, protection off")
            run_round(rnd, samples, ks=ks, world=world, steps=steps, root=Path(tmp), console=console)
    return interval_result(samples, ks=ks, world=world, steps=steps, rounds=rounds)


# --- the table and the figure -------------------------------------------------------------------
def _mem_cell(mem: dict | None, part: str) -> str:
    """MiB per rank (fraction of the protected shard)."""
    if mem is None:
        return "-"
    f = mem["fractions"][part]
    mib = sum(mem[p] for p in MEMORY_PARTS) if part == "total" else mem[part]
    return f"{mib / 2**20:.1f}" + ("" if f is None else f" ({f:.0%})")


def table(res: dict) -> Group:
    t = Table(title=f"parity interval K: {res['strategy']}, {res['world']} ranks, {res['steps']} steps x "
                    f"{res['rounds']} interleaved rounds; protection off: mean step {fmt(res['off_step_s'])} s; "
                    f"SIGKILL rank {res['kill']['rank']} at {res['kill']['phase']}")
    for col in ("K", "kill\nstep", "mean\nstep s", "overhead\nvs off", "95% CI", "recovery\ns (median)",
                "steps\nreplayed", "weights\nbitwise"):
        t.add_column(col, justify="right", no_wrap=col == "95% CI")
    m = Table(title="memory per rank, MiB (fraction of the protected optimizer shard)")
    for col in ("K", "protected", "parity", "snapshot", "gradient log", "total"):
        m.add_column(col, justify="right")
    for k in map(str, res["ks"]):
        ci, mem = res["overhead_ci95"][k], res["memory"][k]
        t.add_row(k, str(res["kill"]["step"][k]), fmt(res["mean_step_s"][k]),
                  f"{res['overhead'][k]:+.1%}", f"[{ci[0]:+.0%}, {ci[1]:+.0%}]", f"{res['recovery_s'][k]:.2f}",
                  str(res["steps_replayed"][k]), "[green]yes[/]" if res["bitwise"][k] else "[red]NO[/]")
        m.add_row(k, "-" if mem is None else f"{mem['protected'] / 2**20:.1f}",
                  *(_mem_cell(mem, p) for p in (*MEMORY_PARTS, "total")))
    return Group(t, m)


def plot(res: dict, path: str | Path) -> None:
    """Three panels against K: overhead % with its CI, recovery s (median, rounds as dots), memory fractions."""
    from unbroken.figures import plt, save_png

    ks, keys = res["ks"], [str(k) for k in res["ks"]]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8), dpi=120)
    try:
        y = [100 * res["overhead"][k] for k in keys]
        err = [[yy - 100 * res["overhead_ci95"][k][0] for yy, k in zip(y, keys)],
               [100 * res["overhead_ci95"][k][1] - yy for yy, k in zip(y, keys)]]
        a.errorbar(ks, y, yerr=err, fmt="o-", capsize=4, color="C0")
        a.axhline(0, color="0.5", linestyle=":", linewidth=0.8)
        a.set_ylabel("step overhead vs off, % (mean, 95% CI)")
        b.plot(ks, [res["recovery_s"][k] for k in keys], "o-", color="C1", label="median")
        for k, kk in zip(keys, ks):
            rs = [s["recovery_s"] for s in res["samples"]["kill"][k]]
            b.plot([kk] * len(rs), rs, ".", color="C1", alpha=0.4)
            b.annotate(f"{res['steps_replayed'][k]} replayed", (kk, res["recovery_s"][k]), fontsize=7,
                       textcoords="offset points", xytext=(4, 4))
        b.set_ylabel("recovery s (kill -> first step done)")
        b.set_ylim(bottom=0)
        for i, part in enumerate(MEMORY_PARTS):
            fr = [(res["memory"][k] or {}).get("fractions", {}).get(part) for k in keys]
            c.plot(ks, [100 * f if f is not None else float("nan") for f in fr], "os^"[i] + "-:-"[i],
                   color=f"C{i + 2}", label=part.replace("_", " "), markersize=7 - 2 * i)
        c.set_ylabel("memory per rank, % of protected shard")
        c.set_ylim(bottom=0)
        c.legend(fontsize=7)
        for ax in (a, b, c):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ks, [str(k) for k in ks])
            ax.set_xlabel("parity interval K (protect_every)")
            ax.grid(True, alpha=0.3)
        fig.suptitle(f"tier-1 parity interval, {res['strategy']}, {res['world']} ranks, {res['steps']} steps x "
                     f"{res['rounds']} rounds", fontsize=9)
        fig.tight_layout()
        save_png(fig, path)
    finally:
        plt.close(fig)


# --- the command --------------------------------------------------------------------------------
def interval(ks: str = typer.Option(",".join(map(str, DEFAULT_KS)), "--ks",
                                   help="parity intervals K (protect_every), comma-separated"),
             world: int = typer.Option(4, "--world", help="ranks"),
             steps: int = typer.Option(48, "--steps", help="steps per run"),
             rounds: int = typer.Option(3, "--rounds", help="interleaved rounds of off, K1, K2, ..."),
             out_dir: Path = typer.Option(RESULTS_DIR, "--out-dir", help="for interval.json and interval.png"),
             ) -> None:
    """Parity interval K: failure-free overhead (95% CI), recovery time, steps replayed and memory, vs K."""
    try:
        sizes = parse_ks(ks)
        validate(ks=sizes, world=world, steps=steps, rounds=rounds)
    except ValueError as e:  # a ConfigError too
        raise typer.BadParameter(str(e)) from None
    res = measure(ks=sizes, world=world, steps=steps, rounds=rounds)
    console = Console()
    console.print(table(res))
    console.print(f"wrote {write_result('interval', res, out_dir)}")
    plot(res, Path(out_dir) / "interval.png")
    console.print(f"wrote {Path(out_dir) / 'interval.png'}")
