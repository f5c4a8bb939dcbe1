"""`unbroken bench rl`: the same RL job (same processes, samples and seed, one warm start) under every
static split of the processes into rollout and training pools, the even split, colocated time-sharing
(every process generates, then every process trains: on-policy) and dynamic reallocation, with
long-tailed and with uniform completion lengths, in one run on one pool of processes. Reports
samples/s, time to a target reward (the lowest final reward among the methods: all reach it), each
pool's idle fraction and the length distribution. Each worker runs in a dedicated CPU slice
(`rl.slices`, when the machine allows it), as each would own a device. Writes bench/results/rl.json and rl.png (reward
curves, the dynamic run's pool sizes over time, idle fractions).
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from unbroken.bench.common import RESULTS_DIR, fmt, goal, write_result
from unbroken.rl.config import RLConfig
from unbroken.rl.errors import RLInputError

BEST_STATIC_GOAL, EVEN_GOAL, UNIFORM_SLACK = 1.3, 1.5, 0.05
# The benchmark's policy: 0.8M parameters, so a step (~0.15 s) outweighs the coordinator's per-message
# costs; with the default 0.1M-parameter policy a step is ~40 ms and the figures measure pipes and
# wake-ups more than the pools' balance (docs/rl.md).
BENCH_POLICY = {"n_embd": 128, "n_layer": 4, "n_head": 4}


def methods(processes: int) -> list[tuple[str, str, int]]:
    """(name, method, rollout workers at the start): every static split, colocated, dynamic (even start)."""
    even = processes // 2
    return ([(f"static-{r}r{processes - r}t", "static", r) for r in range(1, processes)]
            + [("colocated", "colocated", processes), ("dynamic", "dynamic", even)])


def even_name(processes: int) -> str:
    return f"static-{processes // 2}r{processes - processes // 2}t"


def run_mode(pool, cfg: RLConfig, init: bytes, work: Path, console: Console, repeats: int) -> dict:
    """Every method `repeats` times, interleaved (the shared machine's drift hits all alike):
    samples/s and time to target are medians, reward and idle fractions means over the repeats."""
    from unbroken.rl import run as rlrun
    from unbroken.rl.metrics import smoothed, time_to_target

    reps: dict[str, list[dict]] = {}
    for rep in range(repeats):
        for name, method, rollout in methods(pool.size):
            r = rlrun.run(pool, cfg, method, init, work / cfg.lengths / f"{name}-{rep}", rollout=rollout)
            reps.setdefault(name, []).append(r)
            console.print(f"  {cfg.lengths:8s} {name:12s} #{rep}  {r['samples_per_s']:7.1f} samples/s  reward "
                          f"{r['reward_initial']:.3f} -> {r['reward_final']:.3f}  moves {len(r['moves'])}  lends {r['lends']}  "
                          f"helps {r['helps']}")
    target = min(smoothed([c["reward"] for c in r["curve"]])[-1] for rs in reps.values() for r in rs)
    ttt = {n: [time_to_target(r["curve"], target) for r in rs] for n, rs in reps.items()}
    sps = {n: statistics.median(r["samples_per_s"] for r in rs) for n, rs in reps.items()}
    statics = [n for n in sps if n.startswith("static-")]
    best = max(statics, key=lambda n: sps[n])
    return {"runs": {n: rs[-1] for n, rs in reps.items()}, "target_reward": target, "best_static": best,
            "samples_per_s": sps, "samples_per_s_each": {n: [r["samples_per_s"] for r in rs] for n, rs in reps.items()},
            "reward_final": {n: statistics.fmean(r["reward_final"] for r in rs) for n, rs in reps.items()},
            "time_to_target_s": {n: statistics.median(t) if None not in t else None for n, t in ttt.items()},
            "idle": {n: {p: statistics.fmean(r["idle"][p] or 0.0 for r in rs) for p in rs[0]["idle"]}
                     for n, rs in reps.items()},
            "moves": {n: [len(r["moves"]) for r in rs] for n, rs in reps.items()},
            "lends": {n: [r["lends"] for r in rs] for n, rs in reps.items()},
            "helps": {n: [r["helps"] for r in rs] for n, rs in reps.items()},
            "lengths": reps["dynamic"][-1]["lengths"]}


def measure(cfg: RLConfig, work: Path, console: Console, repeats: int = 1, slices: bool = True) -> dict:
    from unbroken.rl.pool import Pool
    from unbroken.rl.run import run as rl_run
    from unbroken.rl.slices import CpuSlices, fair_share
    from unbroken.rl.warm import warm_state

    init = warm_state(cfg, work)
    modes = {}
    cpu, why = CpuSlices.open(fair_share(cfg.processes)) if slices else (None, "--shared-cpu")
    console.print(f"workers in dedicated CPU slices: {cpu.describe()}" if cpu else
                  f"workers share the CPU ({why}): idle time of one pool goes to the other")
    with Pool(cfg.processes, slices=cpu) as pool:
        warmup = RLConfig(**{**cfg.to_dict(), "steps": 2})  # first commands pay for imports: not measured
        rl_run(pool, warmup, "static", init, work / "warmup", rollout=cfg.processes // 2)
        for lengths in ("longtail", "uniform"):
            modes[lengths] = run_mode(pool, RLConfig(**{**cfg.to_dict(), "lengths": lengths}), init, work, console,
                                      repeats)
    lt, un = modes["longtail"], modes["uniform"]
    even = even_name(cfg.processes)
    sps, sps_u = lt["samples_per_s"], un["samples_per_s"]
    return {"config": cfg.to_dict(), "cpu_slices": cpu.describe() if cpu else None,
            "cpu_slices_absent_because": why, "staleness": {"static": cfg.staleness, "dynamic": cfg.staleness,
                                                   "colocated": 0},
            "even_split": even, "best_static": lt["best_static"],
            "speedup_vs_best_static": sps["dynamic"] / sps[lt["best_static"]],
            "speedup_vs_even": sps["dynamic"] / sps[even],
            "uniform_slowdown": 1.0 - sps_u["dynamic"] / sps_u[un["best_static"]],
            "samples_per_s": sps, "reward_final": lt["reward_final"],
            "time_to_target_s": lt["time_to_target_s"], "target_reward": lt["target_reward"],
            "idle": lt["idle"], "lengths": {"longtail": lt["lengths"], "uniform": un["lengths"]},
            "samples_per_s_each": lt["samples_per_s_each"], "moves": lt["moves"], "lends": lt["lends"], "helps": lt["helps"],
            "repeats": repeats,
            "uniform": {k: un[k] for k in ("samples_per_s", "samples_per_s_each", "reward_final", "time_to_target_s",
                                           "target_reward", "idle", "best_static", "moves")},
            "dynamic_pool_sizes": lt["runs"]["dynamic"]["pool_sizes"], "dynamic_moves": lt["runs"]["dynamic"]["moves"],
            "curves": {m: {n: [(c["t"], c["reward"]) for c in r["curve"]] for n, r in modes[m]["runs"].items()}
                       for m in modes}}


def table(res: dict) -> Table:
    t = Table(title=f"RL post-training, {res['config']['processes']} processes, "
                    f"{res['config']['steps']} steps x {res['config']['prompts'] * res['config']['group']} samples "
                    f"(staleness: static/dynamic {res['config']['staleness']}, colocated 0)")
    for col in ("method", "samples/s long-tail", "samples/s uniform", "reward final", "time to target s",
                "idle rollout", "idle train"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for name, sps in res["samples_per_s"].items():
        idle = res["idle"][name]
        t.add_row(name, fmt(sps, 1), fmt(res["uniform"]["samples_per_s"][name], 1), fmt(res["reward_final"][name]),
                  fmt(res["time_to_target_s"][name], 2), fmt(idle.get("rollout", idle.get("both")), 2),
                  fmt(idle.get("train", idle.get("both")), 2))
    return t


def plot(res: dict, path: Path) -> None:
    from unbroken.figures import plt, save_png
    from unbroken.rl.metrics import smoothed

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for name, pts in res["curves"]["longtail"].items():
        ax[0].plot([p[0] for p in pts], smoothed([p[1] for p in pts]), label=name)
    ax[0].axhline(res["target_reward"], color="grey", lw=0.8, ls=":")
    ax[0].set(xlabel="seconds", ylabel="mean reward (5-step mean)", title="reward (long-tail lengths), target dotted")
    ax[0].legend(fontsize=7)
    sizes = res["dynamic_pool_sizes"]
    ts = [s[0] for s in sizes] + [res["curves"]["longtail"]["dynamic"][-1][0]]
    ax[1].step(ts, [s[1] for s in sizes] + [sizes[-1][1]], where="post", label="rollout")
    ax[1].step(ts, [s[2] for s in sizes] + [sizes[-1][2]], where="post", label="train", ls="--")
    ax[1].set(xlabel="seconds", ylabel="processes", title="dynamic: pool sizes over time",
              ylim=(0, res["config"]["processes"] + 0.5))
    ax[1].legend()
    names = list(res["idle"])
    for i, pool in enumerate(("rollout", "train")):
        vals = [res["idle"][n].get(pool, res["idle"][n].get("both")) or 0.0 for n in names]
        ax[2].bar([x + 0.4 * i for x in range(len(names))], vals, width=0.4, label=pool)
    ax[2].set_xticks([x + 0.2 for x in range(len(names))], names, rotation=30, fontsize=7)
    ax[2].set(ylabel="idle fraction", title="pool idle fraction (long-tail)")
    ax[2].legend()
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def rl(quick: bool = typer.Option(False, "--quick", help="smoke run: 1-digit task, few steps"),
       processes: int = typer.Option(4, "--processes", help="worker processes in every method"),
       steps: int = typer.Option(40, "--steps", help="training steps of every run"),
       repeats: int = typer.Option(3, "--repeats", help="runs of every method (interleaved); medians reported"),
       staleness: int = typer.Option(0, "--staleness", help="static and dynamic: 0 (on-policy, as colocated "
                                     "always is) or 1"),
       n_embd: int = typer.Option(BENCH_POLICY["n_embd"], "--n-embd", help="policy width"),
       n_layer: int = typer.Option(BENCH_POLICY["n_layer"], "--n-layer", help="policy depth"),
       seed: int = typer.Option(0, "--seed"),
       slices: bool = typer.Option(True, "--cpu-slices/--shared-cpu", help="each worker in a CPU cgroup of its "
                                   "own (cores/processes; needs root), so idle time is lost as on a device"),
       out: Path = typer.Option(RESULTS_DIR, "--out", help="directory for rl.json and rl.png")) -> None:
    """Every static split, even split, colocated and dynamic: samples/s, time to target, idle fractions."""
    import torch

    from unbroken.cli_error import fail

    torch.set_num_threads(1)
    try:
        if repeats < 1:
            raise RLInputError(f"--repeats must be >= 1, got {repeats}")
        if processes < 2:
            raise RLInputError(f"--processes {processes}: the benchmark needs >= 2 (a rollout and a training pool)")
        base = dict(processes=processes, rollout=processes // 2, staleness=staleness, seed=seed)
        cfg = RLConfig(**base, steps=min(steps, 6), digits=1, prompts=4, group=4, pretrain_steps=60) if quick \
            else RLConfig(**base, steps=steps, n_embd=n_embd, n_layer=n_layer, n_head=BENCH_POLICY["n_head"])
    except RLInputError as e:
        fail(str(e))
    console = Console()
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-rl-") as tmp:
        res = measure(cfg, Path(tmp), console, 1 if quick else repeats, slices=slices)
    res["quick"] = quick
    console.print(table(res))
    console.print(f"dynamic vs best static ({res['best_static']}): {res['speedup_vs_best_static']:.2f}x "
                  f"(goal >= {BEST_STATIC_GOAL}: {goal(res['speedup_vs_best_static'] >= BEST_STATIC_GOAL)}); "
                  f"vs even ({res['even_split']}): {res['speedup_vs_even']:.2f}x (goal >= {EVEN_GOAL}: "
                  f"{goal(res['speedup_vs_even'] >= EVEN_GOAL)}); uniform lengths: {res['uniform_slowdown']:+.1%} "
                  f"behind the best static (goal <= {UNIFORM_SLACK:.0%}: "
                  f"{goal(res['uniform_slowdown'] <= UNIFORM_SLACK)})")
    ls = res["lengths"]["longtail"]
    console.print(f"long-tail completion lengths: mean {ls['mean']:.1f} p50 {ls['p50']} p90 {ls['p90']} "
                  f"p99 {ls['p99']} max {ls['max']}")
    path = write_result("rl", res, out)
    plot(res, Path(out) / "rl.png")
    console.print(f"wrote {path} and {Path(out) / 'rl.png'}")
