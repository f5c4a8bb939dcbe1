"""`unbroken bench overlap`: step time with and without computation–communication overlap.

Configs: `loopback` (1 node x 4 ranks on loopback: compute-bound on this machine) and two
communication-heavy ones, 2 network namespaces x 2 ranks whose links are shaped with `tc tbf`
(plan/netns.py) at 1 Gbit/s (`1gbit`) and 200 Mbit/s (`200mbit`). Methods, interleaved round
by round in one run (the same model, batches and optimizer; the ddp strategy, no checkpoints):

    none     unbroken --overlap off: buckets all-reduced after backward
    ddp      torch DDP (default 25 MB buckets, its own overlap) under torchrun
    default  unbroken --overlap on: buckets all-reduced from the gradient hooks
    tuned    unbroken --overlap FILE: searched in the first round (that run's step 1 carries the
             search, which the untimed warm-up steps drop), read from FILE afterwards

step_s: mean steady step time of rank 0 (steps after SKIP_STEPS), the mean of each run's mean.
Exposed communication: the time a step waits for gradient all-reduces after backward (and for
the parameter all-gather), from unbroken's per-phase `step` events, less the update work done
between bucket waits (`eager_s`, parallel/eager.py; `eager_steps` counts the timed steps that did
such work, kept or undone after a wrong guess: eager runs on the guess of an unclipped step, made
only after an unclipped step;
`--grad-clip` sets every method's clipping, recorded as `grad_clip`); for torch DDP it is
estimated as its step minus none's compute and its own update (DDP logs no phase of its own for
the all-reduce). hidden = 1 - exposed / exposed(none). cut_vs_none, cut_vs_ddp: 1 - step_s(tuned)
/ step_s(other), per config, and at the top the smaller of the two communication-heavy configs'.
tuned_search: the search's measured table (the `overlap_tuned` event of the run that searched).
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from rich.table import Table

from unbroken.bench.baseline import read_log
from unbroken.bench.common import SKIP_STEPS, fmt, goal, job_events, run_job, step_events
from unbroken.config import ModelConfig, RunConfig

CONFIGS = {"loopback": None, "1gbit": 1000.0, "200mbit": 200.0}  # link Mbit/s (None: one node, loopback)
COMM_HEAVY = ("1gbit", "200mbit")
METHODS = ("none", "ddp", "default", "tuned")
MODE = {"none": "off", "default": "on"}  # tuned: the plan file
GOAL_CUT_VS_NONE, GOAL_CUT_VS_DDP = 0.20, 0.10
_PORT = 29711
SHAPED_LEASE_S = 8.0  # node lease of the unbroken jobs on the shaped links (run_shaped)
WORLD, NODES = 4, 2


def bench_config(*, steps: int, quick: bool, grad_clip: float | None = None) -> RunConfig:
    """grad_clip None: the job's default (1.0); 0 turns clipping off (every method alike)."""
    model = ModelConfig(n_layer=2, n_embd=64) if quick else ModelConfig()
    cfg = RunConfig(world_size=WORLD, steps=steps, strategy="ddp", checkpoint_every=0, model=model,
                    batch_size=4 if quick else 8)
    return cfg if grad_clip is None else cfg.replace(grad_clip=grad_clip)


def _unbroken_flags(cfg: RunConfig, overlap: str) -> tuple[str, ...]:
    m = cfg.model
    return ("--overlap", overlap, "--checkpoint-every", "0", "--batch-size", str(cfg.batch_size),
            "--n-layer", str(m.n_layer), "--n-embd", str(m.n_embd), "--collectives", cfg.collectives)


def _unbroken_record(run_dir: Path) -> dict:
    events = job_events(run_dir)
    steps = [e.fields for e in step_events(events) if e.fields.get("step", 0) > SKIP_STEPS]
    plan = next((e.fields for e in events if e.kind == "overlap_plan" and e.rank == 0), None)
    timeline = next((e.fields for e in events if e.kind == "overlap_timeline"), None)
    search = next((e.fields for e in events if e.kind == "overlap_tuned" and e.rank == 0), None)
    mean = lambda k: statistics.fmean(float(s.get(k, 0.0)) for s in steps)  # noqa: E731
    step_of = next((s for s in steps if timeline and s["step"] == timeline["step"]), None)
    # eager_s: update work done inside the all-reduce wait (parallel/eager.py): not communication
    return {"step_s": mean("step_s"), "compute_s": mean("compute_s"), "update_s": mean("update_s"),
            "eager_s": mean("eager_s"), "eager_steps": sum(float(s.get("eager_s", 0.0)) > 0 for s in steps),
            "timed_steps": len(steps),
            "exposed_comm_s": mean("allreduce_s") - mean("eager_s") + mean("allgather_s"), "plan": plan,
            "search": search,
            "timeline": {**timeline, "phases": step_of} if timeline and step_of else None}


def _ddp_record(run_dir: Path) -> dict:
    recs = [r for r in read_log(run_dir) if r["event"] == "step" and r["rank"] == 0 and r["step"] > SKIP_STEPS]
    return {"step_s": statistics.fmean(r["step_s"] for r in recs),
            "compute_s": statistics.fmean(r["compute_s"] for r in recs),
            "update_s": statistics.fmean(r["update_s"] for r in recs)}


def run_loopback(method: str, cfg: RunConfig, root: Path, plan: Path) -> dict:
    from unbroken.bench.native_job import run_native

    if method == "ddp":
        run_native(cfg, root, optimizer="adamw")
        return _ddp_record(root)
    run_job(cfg.replace(overlap=MODE.get(method, str(plan))), root)
    return _unbroken_record(root)


def run_shaped(method: str, net, cfg: RunConfig, root: Path, plan: Path, port: int) -> dict:
    from unbroken.bench.multinode import run_once

    system = "torchrun-ddp" if method == "ddp" else "unbroken-ddp"
    flags = () if method == "ddp" else _unbroken_flags(cfg, MODE.get(method, str(plan)))
    if method != "ddp":  # the job's own config file: what its flags do not carry (torch DDP reads cfg whole)
        # a node lease for a thin, saturated link on a shared host (docs/benchmarks.md): the 3 s
        # default once fenced node 1 at 200 Mbit/s while its lease renewals queued behind gradients
        (root / "job.toml").write_text(f"grad_clip = {float(cfg.grad_clip)!r}\nnode_lease_s = {SHAPED_LEASE_S}\n")
        flags = (*flags, "--config", str(root / "job.toml"))
    run_once(system, net, NODES, cfg, root, port, flags)
    return _ddp_record(root / "node0") if method == "ddp" else _unbroken_record(root / "node0")


def measure(*, steps: int, rounds: int, configs: tuple[str, ...], quick: bool, grad_clip: float | None = None,
            collectives: str = "gloo", log=print) -> dict:
    """Every method of every config, interleaved per round; returns the result (see `result`).
    `collectives`: unbroken's gradient all-reduce on the two-node configs (loopback is one node: gloo's)."""
    cfg = bench_config(steps=steps, quick=quick, grad_clip=grad_clip)
    runs: dict[str, dict[str, list[dict]]] = {c: {m: [] for m in METHODS} for c in configs}
    n = 0  # runs so far: each shaped run gets a port of its own (no TIME_WAIT from the last one)
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            plan = Path(tmp) / f"plan-{config}.json"  # tuned once per config, then read from the file
            with _wiring(config) as net:
                for r in range(rounds):
                    for method in METHODS:
                        log(f"{config}: {method} round {r + 1}/{rounds}")
                        root = Path(tmp) / f"{config}-{method}-{r}"
                        if net is None:
                            runs[config][method].append(run_loopback(method, cfg, root, plan))
                        else:
                            root.mkdir()
                            n += 1
                            runs[config][method].append(run_shaped(method, net, cfg.replace(collectives=collectives),
                                                                   root, plan, _PORT + n))
    return {**result(runs, steps=steps, rounds=rounds, cfg=cfg), "collectives_two_nodes": collectives}


class _wiring:
    """The config's namespaces (None for loopback), torn down on exit."""

    def __init__(self, config: str) -> None:
        self.config, self.net = config, None

    def __enter__(self):
        if CONFIGS[self.config] is None:
            return None
        from unbroken.plan.netns import Netns, Wiring

        self.net = Netns(Wiring.uniform(self.config, NODES, CONFIGS[self.config])).__enter__()
        return self.net

    def __exit__(self, *exc) -> None:
        if self.net is not None:
            self.net.__exit__(*exc)


def result(runs: dict, *, steps: int, rounds: int, cfg: RunConfig) -> dict:
    """step_s[method] per config, exposed/hidden communication, the cuts, the goals."""
    per: dict[str, dict] = {}
    for config, by_method in runs.items():
        mean = {m: statistics.fmean(r["step_s"] for r in rs) for m, rs in by_method.items()}
        exposed = {m: statistics.fmean(r["exposed_comm_s"] for r in rs) for m, rs in by_method.items() if m != "ddp"}
        none_compute = statistics.fmean(r["compute_s"] for r in by_method["none"])
        exposed["ddp"] = max(0.0, mean["ddp"] - none_compute - statistics.fmean(r["update_s"] for r in by_method["ddp"]))
        base = exposed["none"]
        per[config] = {
            "step_s": mean, "exposed_comm_s": exposed,
            "hidden": {m: (1 - e / base) if base > 0 else None for m, e in exposed.items()},
            "cut_vs_none": 1 - mean["tuned"] / mean["none"], "cut_vs_ddp": 1 - mean["tuned"] / mean["ddp"],
            "cut_default_vs_ddp": 1 - mean["default"] / mean["ddp"],
            "tuned_plan": by_method["tuned"][-1]["plan"], "default_plan": by_method["default"][-1]["plan"],
            # the tuner's measured table (overlap_tuned), from the run that searched
            "tuned_search": next((r["search"] for r in by_method["tuned"] if r.get("search")), None),
            "timelines": {m: by_method[m][-1]["timeline"] for m in ("none", "default", "tuned")},
            "samples": {m: [round(r["step_s"], 5) for r in rs] for m, rs in by_method.items()},
            # timed steps whose update was (partly) applied as buckets landed, over all rounds
            "eager_steps": {m: [sum(r.get("eager_steps", 0) for r in rs), sum(r.get("timed_steps", 0) for r in rs)]
                            for m, rs in by_method.items() if m != "ddp"},
        }
    heavy = [c for c in COMM_HEAVY if c in per]
    cut_none = min((per[c]["cut_vs_none"] for c in heavy), default=None)
    cut_ddp = min((per[c]["cut_vs_ddp"] for c in heavy), default=None)
    compute_ok = None if "loopback" not in per else per["loopback"]["step_s"]["tuned"] <= per["loopback"]["step_s"]["ddp"]
    return {"configs": per, "cut_vs_none": cut_none, "cut_vs_ddp": cut_ddp, "steps": steps, "rounds": rounds,
            "grad_clip": cfg.grad_clip,
            "world_size": cfg.world_size, "model": cfg.model.__dict__, "batch_size": cfg.batch_size,
            "goals": {"cut_vs_none": GOAL_CUT_VS_NONE, "cut_vs_ddp": GOAL_CUT_VS_DDP,
                      "met_cut_vs_none": None if cut_none is None else cut_none >= GOAL_CUT_VS_NONE,
                      "met_cut_vs_ddp": None if cut_ddp is None else cut_ddp >= GOAL_CUT_VS_DDP,
                      "compute_bound_not_slower_than_ddp": compute_ok}}


def table(res: dict) -> Table:
    t = Table(title=f"overlap: step time (s), {res['steps']} steps x {res['rounds']} rounds, {res['world_size']} ranks")
    for col in ("config", *METHODS, "exposed none/default/tuned (s)", "hidden tuned", "cut vs none", "cut vs DDP"):
        t.add_column(col)
    for config, c in res["configs"].items():
        e = c["exposed_comm_s"]
        t.add_row(config, *(fmt(c["step_s"][m]) for m in METHODS),
                  f"{fmt(e['none'])} / {fmt(e['default'])} / {fmt(e['tuned'])}", fmt(c["hidden"]["tuned"], 2),
                  fmt(c["cut_vs_none"], 3), fmt(c["cut_vs_ddp"], 3))
    g = res["goals"]
    t.caption = (f"comm-heavy cut vs none {fmt(res['cut_vs_none'])} (goal {g['cut_vs_none']}: {goal(g['met_cut_vs_none'])}), "
                 f"vs DDP {fmt(res['cut_vs_ddp'])} (goal {g['cut_vs_ddp']}: {goal(g['met_cut_vs_ddp'])}); "
                 f"compute-bound not slower than DDP: {goal(g['compute_bound_not_slower_than_ddp'])}")
    return t


def plot_timeline(res: dict, path: Path) -> None:
    """One step per unbroken method of the most communication-heavy config measured: compute,
    each bucket's all-reduce (issued .. seen done), the exposed wait, the update (eager and after)."""
    from unbroken.figures import plt, save_png

    config = next((c for c in reversed(CONFIGS) if c in res["configs"]), None)
    lines = {m: tl for m, tl in res["configs"][config]["timelines"].items() if tl}
    fig, ax = plt.subplots(figsize=(9, 1.2 + 1.1 * max(1, len(lines))), dpi=120)
    try:
        for row, (m, tl) in enumerate(lines.items()):
            ph = tl["phases"]
            eager = ph.get("eager_s", 0.0)  # update work between bucket waits, drawn after them in one piece
            compute, wait, update = ph["compute_s"], ph["allreduce_s"] - eager, ph["update_s"]
            start = compute - tl["backward_s"]  # when the buckets' clock started (backward, or after it)
            y = row * 2
            ax.broken_barh([(0, compute)], (y + 1, 0.8), color="C0", label="forward + backward" if row == 0 else None)
            ax.broken_barh([(compute, wait)], (y + 1, 0.8), color="C3", label="exposed wait" if row == 0 else None)
            ax.broken_barh([(compute + wait, eager)], (y + 1, 0.8), color="C2", alpha=0.5,
                           label="update as buckets land" if row == 0 else None)
            ax.broken_barh([(compute + wait + eager, update)], (y + 1, 0.8), color="C2",
                           label="update" if row == 0 else None)
            spans = [(start + a, (b if b is not None else tl["end_s"]) - a) for a, b in tl["buckets"]]
            ax.broken_barh(spans, (y + 0.1, 0.8), color="C1", alpha=0.6, edgecolor="k", linewidth=0.3,
                           label="bucket all-reduce" if row == 0 else None)
        ax.set_yticks([r * 2 + 1 for r in range(len(lines))], [f"{m}\n(step {tl['step']})" for m, tl in lines.items()])
        ax.set_xlabel("seconds from the start of the step (rank 0)")
        ax.set_title(f"one step on {config}: compute and gradient communication", fontsize=9)
        ax.set_ylim(0, 2 * len(lines) + 0.9)  # headroom for the legend
        ax.legend(loc="upper right", fontsize=7, ncol=4)
        ax.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        save_png(fig, path)
    finally:
        plt.close(fig)
