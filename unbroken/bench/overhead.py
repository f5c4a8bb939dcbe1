"""`unbroken bench overhead`: what unbroken costs a failure-free run, against native PyTorch.

For each strategy (`unbroken.config.STRATEGIES`) and world size the same tiny-GPT job runs
three ways, interleaved round by round (native, off, default, native, off, default, ...)
so that the shared machine's drift hits all three alike:

    native   the strategy's torch peer under torchrun (`native_job.py`), no checkpoints
    off      unbroken, protection off: tier1=False, checkpoint_every=0
    default  unbroken as a user gets it: RunConfig defaults (tier 1 parity every
             protect_every steps, the default tier-2 checkpoint_every)

Measurement rules (this module owns them):

- Steps 1..SKIP_STEPS are warm-up and dropped in every variant. The steady window then
  holds a whole number of periods lcm(protect_every, checkpoint_every) when the run has
  room for one, so that parity and checkpoint steps are neither over- nor under-counted;
  every variant of a (strategy, world) uses the same window.
- The throughput ratio is mean_step(native) / mean_step(variant) (= tokens/s ratio; > 1
  is faster than native). The MEAN, not the median: with protect_every=K every K-th step
  carries the parity work and checkpoint steps carry the snapshot, which a median hides.
  Means are pooled as the sum over rounds of each run's mean (equal weight per run).
  Medians are reported beside them.
- 95% CI: a two-stage paired bootstrap (RESAMPLES resamples, fixed SEED). Stage 1
  resamples rounds with replacement and keeps a round's runs together, so a round that
  was slow for everyone moves numerator and denominator alike; stage 2 resamples the steps
  inside each picked run, which still gives an interval with 1-2 rounds (stage 1 alone
  would give none) and makes it somewhat conservative with many. The statistic is the same
  as the point estimate; the percentile interval is widened to include the point estimate
  in the rare tiny-sample cases where it would not.
- Decomposition, each as a fraction of the native mean step (they add up to the total):
  runtime = off - native; tier1 = default - off over steps untouched by a checkpoint (and
  the same in the update phase alone, where parity work lives); tier2 = the checkpoint
  steps' extra time amortized over all steps (default - default without them). A
  checkpoint touches the step it follows and the next one, whose time holds the snapshot;
  a parity step that is also checkpoint-touched is counted in tier 2. Native phases are
  compute (DDP's overlapped all-reduce inside) and update only, so runtime is a total.

Goal: ratio >= GOAL_RATIO with the CI's lower bound >= GOAL_CI_LOWER.
"""
from __future__ import annotations

import math
import statistics
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console, Group
from rich.table import Table

from unbroken.bench import native_job
from unbroken.bench.common import SKIP_STEPS, fmt, goal, job_events, run_job, step_events
from unbroken.bench.percentile import percentile_interval
from unbroken.config import STRATEGIES, RunConfig

VARIANTS = ("native", "off", "default")
PHASES = ("compute_s", "allreduce_s", "update_s", "allgather_s")
GOAL_RATIO = 0.98
GOAL_CI_LOWER = 0.97
RESAMPLES = 2000
SEED = 0


# --- configurations -----------------------------------------------------------------------------
def variant_config(variant: str, strategy: str, world: int, steps: int, backend: str = "auto",
                   device: str = "auto") -> RunConfig:
    """The RunConfig of one variant (native uses it for the model, batches, schedule and backend only)."""
    if variant == "default":
        return RunConfig(strategy=strategy, world_size=world, steps=steps, backend=backend, device=device)
    if variant in ("off", "native"):
        return RunConfig(strategy=strategy, world_size=world, steps=steps, tier1=False, checkpoint_every=0,
                         backend=backend, device=device)
    raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")


def default_protection() -> dict:
    """protect_every and checkpoint_every of a default RunConfig, as they are at run time."""
    d = RunConfig()
    return {"protect_every": getattr(d, "protect_every", None), "checkpoint_every": d.checkpoint_every}


def period(protect_every: object, checkpoint_every: int) -> int:
    """Steps after which the pattern of parity and checkpoint steps repeats (1 if unknown)."""
    p = protect_every if isinstance(protect_every, int) and not isinstance(protect_every, bool) else 1
    return math.lcm(max(1, p), checkpoint_every) if checkpoint_every > 0 else max(1, p)


def steady_window(steps: int, *, skip: int = SKIP_STEPS, period: int = 1) -> tuple[int, int]:
    """(first, last) steady step: after `skip`, a whole number of periods if at least one fits."""
    n = steps - skip
    if n < 2:
        raise ValueError(f"--steps {steps} leaves {max(n, 0)} steady step(s) after {skip} warm-up steps; "
                         f"use --steps {skip + 8} or more")
    whole = n // period * period
    return skip + 1, skip + (whole or n)


def in_window(records: list[dict], window: tuple[int, int]) -> list[dict]:
    return [r for r in records if window[0] <= r["step"] <= window[1]]


def checkpoint_touched(step: int, every: int) -> bool:
    """True for a step a tier-2 checkpoint slows: the one it follows and the next (the snapshot's)."""
    return every > 0 and (step % every == 0 or (step > 1 and (step - 1) % every == 0))


# --- statistics ---------------------------------------------------------------------------------
def pooled_mean(runs: list[list[float]]) -> float:
    """Mean over runs of each run's mean step (every run weighs the same)."""
    if not runs or not all(runs):
        raise ValueError("every run needs at least one steady step; run more --steps")
    return statistics.fmean(statistics.fmean(r) for r in runs)


def mean_ratio(base: list[list[float]], var: list[list[float]]) -> float:
    """mean_step(base) / mean_step(var): > 1 means `var` is faster (more tokens/s) than `base`."""
    if len(base) != len(var):
        raise ValueError(f"paired rounds differ: {len(base)} base runs, {len(var)} variant runs")
    return pooled_mean(base) / pooled_mean(var)


def _resampled_sums(runs: list[list[float]], picks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """For each resample (row of `picks`, round indices): sum over slots of a step-resampled run mean."""
    lens = np.array([len(r) for r in runs])
    width = int(lens.max())
    vals = np.zeros((len(runs), width))
    for i, r in enumerate(runs):
        vals[i, :len(r)] = r
    n = lens[picks]                                                    # (B, R) steps of each picked run
    j = (rng.random((*picks.shape, width)) * n[..., None]).astype(np.int64)   # indices < n
    mask = np.arange(width) < n[..., None]
    means = (vals[picks[..., None], j] * mask).sum(-1) / n
    return means.sum(-1)


def bootstrap_ci(base: list[list[float]], var: list[list[float]], *, resamples: int = RESAMPLES,
                 seed: int = SEED, level: float = 0.95) -> tuple[float, float]:
    """Two-stage paired bootstrap CI of mean_ratio(base, var) (see the module docstring)."""
    point = mean_ratio(base, var)
    rng = np.random.default_rng(seed)
    rounds = len(base)
    picks = rng.integers(0, rounds, size=(resamples, rounds))
    ratios = _resampled_sums(base, picks, rng) / _resampled_sums(var, picks, rng)
    return percentile_interval(ratios, point, level=level)


def _mean_field(runs: list[list[dict]], key: str, keep=lambda r: True) -> float | None:
    """pooled_mean of `key` over the records `keep` accepts; None if a run has none."""
    vals = [[float(r[key]) for r in run if keep(r) and r.get(key) is not None] for run in runs]
    return pooled_mean(vals) if vals and all(vals) else None


def decompose(runs: dict[str, list[list[dict]]], *, checkpoint_every: int) -> dict:
    """unbroken's cost split into runtime, tier 1 and tier 2, each a fraction of the native mean step."""
    nat, off, dflt = (_mean_field(runs[v], "step_s") for v in VARIANTS)
    clean = (lambda r: not checkpoint_touched(r["step"], checkpoint_every))
    dflt_clean = _mean_field(runs["default"], "step_s", clean)
    separable = dflt_clean is not None
    base = dflt_clean if separable else dflt
    phases = {v: {p: m for p in PHASES if (m := _mean_field(runs[v], p)) is not None} for v in VARIANTS}
    upd_d, upd_o = _mean_field(runs["default"], "update_s", clean), _mean_field(runs["off"], "update_s")
    return {
        "native_step_s": nat, "off_step_s": off, "default_step_s": dflt,
        "runtime": (off - nat) / nat,
        "tier1": (base - off) / nat,
        "tier1_update": (upd_d - upd_o) / nat if upd_d is not None and upd_o is not None else None,
        "tier2": (dflt - dflt_clean) / nat if separable else None,
        "tier2_separable": separable,
        "total": (dflt - nat) / nat,
        "checkpoint_steps_per_run": sum(checkpoint_touched(r["step"], checkpoint_every)
                                        for r in runs["default"][0]) if runs["default"] else 0,
        "phases_s": phases,
    }


# --- the result ---------------------------------------------------------------------------------
def cell_result(cell: dict, *, steps: int, skip: int, protection: dict) -> dict:
    """Ratios, CIs, step statistics and the decomposition of one (strategy, world) from its raw runs."""
    chosen = cell.get("protect_every_chosen")
    k = protection["protect_every"] if isinstance(protection["protect_every"], int) else chosen
    window = steady_window(steps, skip=skip, period=period(k, protection["checkpoint_every"]))
    runs = {v: [in_window(run, window) for run in cell["runs"][v]] for v in VARIANTS}
    times = {v: [[float(r["step_s"]) for r in run] for run in runs[v]] for v in VARIANTS}
    ratio = {v: mean_ratio(times["native"], times[v]) for v in ("off", "default")}
    ci = {v: list(bootstrap_ci(times["native"], times[v])) for v in ("off", "default")}
    return {
        "ratio": ratio, "ci95": ci,
        "goal_met": ratio["default"] >= GOAL_RATIO and ci["default"][0] >= GOAL_CI_LOWER,
        "mean_step_s": {v: pooled_mean(times[v]) for v in VARIANTS},
        "median_step_s": {v: statistics.median(x for run in times[v] for x in run) for v in VARIANTS},
        "decomposition": decompose(runs, checkpoint_every=protection["checkpoint_every"]),
        "window": list(window), "peer": cell["peer"], "protect_every_chosen": chosen, "samples": times,
    }


def overhead_result(cells: dict[str, dict[str, dict]], *, steps: int, rounds: int, worlds: list[int],
                    protection: dict, skip: int = SKIP_STEPS, runs: list[dict] = ()) -> dict:
    """The JSON schema of overhead.json; cells[strategy][world as str] = {"runs": {variant: [records]}, "peer"}."""
    per = {s: {w: cell_result(c, steps=steps, skip=skip, protection=protection) for w, c in ws.items()}
           for s, ws in cells.items()}

    def pick(f):
        return {s: {w: f(c) for w, c in ws.items()} for s, ws in per.items()}

    return {
        "ratio": pick(lambda c: c["ratio"]["default"]), "ci95": pick(lambda c: c["ci95"]["default"]),
        "ratio_off": pick(lambda c: c["ratio"]["off"]), "ci95_off": pick(lambda c: c["ci95"]["off"]),
        "goal": GOAL_RATIO, "goal_ci95_lower": GOAL_CI_LOWER, "goal_met": pick(lambda c: c["goal_met"]),
        "protect_every": protection["protect_every"], "checkpoint_every": protection["checkpoint_every"],
        "protect_every_chosen": pick(lambda c: c["protect_every_chosen"]),
        "rounds": rounds, "steps": steps, "worlds": list(worlds), "strategies": list(cells), "skip_steps": skip,
        "window": pick(lambda c: c["window"]),
        "median_step_s": pick(lambda c: c["median_step_s"]), "mean_step_s": pick(lambda c: c["mean_step_s"]),
        "decomposition": pick(lambda c: c["decomposition"]),
        "peer": {s: next(iter(ws.values()))["peer"] for s, ws in per.items() if ws},
        "bootstrap": {"resamples": RESAMPLES, "seed": SEED, "level": 0.95,
                      "method": "two-stage paired: rounds, then steps within each run"},
        "samples": pick(lambda c: c["samples"]), "runs": list(runs),
    }


# --- running it ---------------------------------------------------------------------------------
def _unbroken_records(run_dir: Path) -> tuple[list[dict], object]:
    """Rank 0's step records (the last execution of each step) and a protect_every the runtime chose."""
    events = job_events(run_dir)
    by_step = {}
    for e in step_events(events):
        by_step[e.fields["step"]] = {"step": e.fields["step"],
                                     **{k: e.fields[k] for k in ("step_s", "loss", *PHASES) if k in e.fields}}
    chosen = next((e.fields["protect_every"] for e in events if "protect_every" in e.fields), None)
    return [by_step[s] for s in sorted(by_step)], chosen


def run_variant(variant: str, strategy: str, world: int, *, steps: int, run_dir: Path, peer: dict,
                console: Console, backend: str = "auto", device: str = "auto") -> dict:
    """One run of one variant: {"records": rank 0's steps, "wall_s", "protect_every_chosen"}."""
    cfg = variant_config(variant, strategy, world, steps, backend, device)
    if variant == "native":
        r = native_job.run_native(cfg, run_dir, optimizer=peer["optimizer"])
        return {"records": r["records"], "wall_s": r["wall_s"], "protect_every_chosen": None}
    s = run_job(cfg, run_dir, console=console)
    if not s["ok"]:
        raise RuntimeError(f"overhead run {variant} ({strategy}, {world} ranks) did not finish; "
                           f"see {run_dir}/events.jsonl")
    records, chosen = _unbroken_records(run_dir)
    return {"records": records, "wall_s": s["wall_s"], "protect_every_chosen": chosen}


def measure_cell(strategy: str, world: int, *, steps: int, rounds: int, root: Path, console: Console,
                 runs_log: list[dict], backend: str = "auto", device: str = "auto") -> dict:
    """All rounds of one (strategy, world), interleaved native, off, default, native, ..."""
    peer = native_job.peer_for(strategy)
    runs: dict[str, list] = {v: [] for v in VARIANTS}
    chosen = None
    for rnd in range(rounds):
        for v in VARIANTS:
            console.log(f"overhead: {strategy}, {world} ranks, round {rnd + 1}/{rounds}, {v}")
            r = run_variant(v, strategy, world, steps=steps, run_dir=root / f"{strategy}-w{world}-{v}-{rnd}",
                            peer=peer, console=console, backend=backend, device=device)
            runs[v].append(r["records"])
            chosen = chosen if r["protect_every_chosen"] is None else r["protect_every_chosen"]
            times = [x["step_s"] for x in r["records"][SKIP_STEPS:]] or [float("nan")]
            runs_log.append({"strategy": strategy, "world": world, "variant": v, "round": rnd,
                             "wall_s": r["wall_s"], "mean_step_s": statistics.fmean(times),
                             # not comparable across: native logs rank 0's loss, unbroken the ranks' mean
                             "final_loss": r["records"][-1].get("loss") if r["records"] else None})
    return {"runs": runs, "peer": peer, "protect_every_chosen": chosen}


def validate(*, steps: int, worlds: list[int], strategies: list[str]) -> None:
    """Raise ValueError (ConfigError included) for settings that would fail only after some runs."""
    steady_window(steps)
    for s in strategies:
        for w in worlds:
            for v in VARIANTS:
                variant_config(v, s, w, steps)


def measure(*, steps: int, rounds: int, worlds: list[int], strategies: list[str] | None = None,
            console: Console | None = None, backend: str = "auto", device: str = "auto") -> dict:
    console = console or Console(stderr=True)
    strategies = list(strategies or STRATEGIES)
    validate(steps=steps, worlds=worlds, strategies=strategies)  # before the first run, not after the last
    protection = default_protection()
    cells: dict[str, dict] = {}
    runs_log: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-overhead-") as tmp:
        for s in strategies:
            cells[s] = {str(w): measure_cell(s, w, steps=steps, rounds=rounds, root=Path(tmp), console=console,
                                             runs_log=runs_log, backend=backend, device=device)
                            for w in worlds}
    return overhead_result(cells, steps=steps, rounds=rounds, worlds=worlds, protection=protection, runs=runs_log)


# --- the table ----------------------------------------------------------------------------------
def _ratio_cell(r: float, ci: list[float]) -> str:
    return f"{r:.3f}\n[{ci[0]:.3f}-{ci[1]:.3f}]"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1%}"


def table(res: dict) -> Group:
    title = (f"failure-free cost vs native PyTorch, {res['steps']} steps x {res['rounds']} interleaved rounds; "
             f"default: protect_every {res['protect_every']}, checkpoint_every {res['checkpoint_every']}. "
             "ratio = mean native step / mean unbroken step (= tokens/s ratio) [95% CI]; step s = mean (median)")
    t = Table(title=title)
    for col in ("strategy", "ranks", "peer", "native s", "off s", "default s", "off / native", "default / native",
                f"goal >= {res['goal']}\nCI lo >= {res['goal_ci95_lower']}"):
        t.add_column(col, justify="right")
    d = Table(title="where unbroken's time goes, as a fraction of the native mean step")
    for col in ("strategy", "ranks", "runtime\n(off - native)", "tier 1,\nupdate phase", "tier 1", "tier 2",
                "total\n(default - native)"):
        d.add_column(col, justify="right")
    for s, ws in res["ratio"].items():
        p = res["peer"][s]
        peer = p.get("short", p["peer"]) + ("\n(fallback)" if p["fallback"] else "")
        for w in ws:
            mean, med, dc = res["mean_step_s"][s][w], res["median_step_s"][s][w], res["decomposition"][s][w]
            t.add_row(s, w, peer, *(f"{fmt(mean[v])}\n({fmt(med[v])})" for v in VARIANTS),
                      _ratio_cell(res["ratio_off"][s][w], res["ci95_off"][s][w]),
                      _ratio_cell(res["ratio"][s][w], res["ci95"][s][w]), goal(res["goal_met"][s][w]))
            d.add_row(s, w, _pct(dc["runtime"]), _pct(dc["tier1_update"]), _pct(dc["tier1"]), _pct(dc["tier2"]),
                      _pct(dc["total"]))
    return Group(t, d)
