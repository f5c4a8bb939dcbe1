"""`unbroken bench split`: serialized, PSL, GPSL and GCPSL (random / size-balanced /
label-aware clusters, one `unbroken run` rank per cluster) on one non-IID split of
Fashion-MNIST across 256 logical clients, every method `--repeats` times interleaved, in one
run: median time to a target accuracy (the serialized baseline's settled level, see
`target_of`), final accuracy, participation; then GCPSL with client dropouts and a cluster worker SIGKILLed mid-round,
checked bitwise against the failure-free run. Every method's clients drop out of a round
with probability 2%. Writes bench/results/split.json + split.png.
"""
from __future__ import annotations

import math
import statistics
import tempfile
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

from unbroken.bench.common import RESULTS_DIR, fmt, goal, median, write_result
from unbroken.split import data, train
from unbroken.split.config import METHODS, SplitConfig
from unbroken.split.launch import run_gcpsl
from unbroken.split.participation import account
from unbroken.split.plan import rounds

GCPSL = tuple(m for m in METHODS if m.startswith("gcpsl"))
SPEEDUP_GOAL, ACCURACY_SLACK = 3.0, 0.01
P_DROP = 0.02  # every method's clients drop out of a round with this chance


def _inprocess(method: str, split, cfg: SplitConfig) -> dict:
    torch.set_num_threads(1)  # one worker's share, as each cluster worker runs (RunConfig.threads = 1)
    fed = train.federation(split, cfg, method)
    curve, _ = train.run(method, split, cfg, fed)
    return {"curve": curve, "startup_s": 0.0, "participation": account(rounds(method, fed, cfg), fed,
                                                                       cfg.samples_per_round)}


def _cluster_job(method: str, split, cfg: SplitConfig, work: Path) -> dict:
    fed = train.federation(split, cfg, method)
    res = run_gcpsl(cfg, method, work / method, cluster_of=fed.cluster_of)
    return {"curve": res.curve, "startup_s": res.startup_s, "job_wall_s": res.wall_s,
            "weights_sha256": res.summary.get("weights_sha256"),
            "participation": account(rounds(method, fed, cfg), fed, cfg.samples_per_round)}


def fault_run(split, cfg: SplitConfig, work: Path, clean: dict) -> dict:
    """GCPSL label-aware again, rank 1 SIGKILLed mid-run after its round's local training,
    before the merge: compared bitwise with the failure-free run `clean`, and with the naive
    in-process reference (clusters one after another; float rounding differs)."""
    method = "gcpsl-label"
    fed = train.federation(split, cfg, method)
    kill_round = max(1, cfg.rounds(len(fed.labels)) // 2)
    kill = f"sigkill:rank=1,step={kill_round},phase=backward"
    res = run_gcpsl(cfg, method, work / "fault", inject=(kill,), cluster_of=fed.cluster_of)
    torch.set_num_threads(1)
    ref_curve, ref = train.run(method, split, cfg, fed)
    diff = max(float((res.state[k] - v).abs().max()) for k, v in ref.state_dict().items())
    return {"method": method, "inject": kill, "recoveries": len(res.summary.get("recoveries", [])),
            "steps_lost": res.summary.get("steps_lost"), "rounds_completed": len(res.curve.points),
            "rounds_planned": cfg.rounds(len(fed.labels)), "final_accuracy": res.curve.final,
            "weights_sha256": res.summary.get("weights_sha256"),
            "same_weights_as_failure_free": res.summary.get("weights_sha256") == clean["weights_sha256"],
            "max_abs_diff_vs_inprocess_reference": diff, "reference_curve": ref_curve}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _share(part: dict) -> dict:
    return {"clients": part["clients"], "samples": part["samples"]}


IN_PROCESS = ("serialized", "psl", "gpsl")
REPEATS = 3


def _one_round_of_runs(split, cfg: SplitConfig, work: Path) -> dict:
    """Every method once: the in-process ones, then each GCPSL variant as a 4-worker job."""
    runs = {m: _inprocess(m, split, cfg) for m in IN_PROCESS}
    runs.update({m: _cluster_job(m, split, cfg, work) for m in GCPSL})
    return runs


def target_of(serialized: list) -> float:
    """The serialized baseline's level once it has settled: the median of its accuracies over
    the last third of its rounds, pooled over the repeats, floored to a point. Its curve swings
    by several points from round to round, so its last round alone would make the target a
    coin toss; the serialized runs do reach this level (at least half of those rounds do)."""
    tail = [p[2] for c in serialized for p in c.points[-max(1, len(c.points) // 3):]]
    return math.floor(100 * statistics.median(tail) + 1e-9) / 100


def _speedups(tt: dict) -> dict:
    return {m: tt["serialized"] / tt[m] for m in GCPSL if tt.get(m) and tt.get("serialized")}


def measure(cfg: SplitConfig, work: Path, *, with_fault: bool = True, repeats: int = REPEATS) -> dict:
    split = data.load(cfg.dataset, cfg.data_dir)
    reps = [_one_round_of_runs(split, cfg, work / f"repeat-{i}") for i in range(repeats)]
    runs = reps[0]  # accuracies, participation and curves: the first repeat (every repeat trains the same)
    target = target_of([r["serialized"]["curve"] for r in reps])
    tt_each = {m: [r[m]["curve"].time_to(target) for r in reps] for m in runs}
    tt = {m: None if None in ts else median(ts) for m, ts in tt_each.items()}  # a repeat that missed: no time
    final = {m: r["curve"].final for m, r in runs.items()}
    speedups = _speedups(tt)
    best = max(speedups, key=speedups.get) if speedups else None
    each = [_speedups({m: ts[i] for m, ts in tt_each.items()}) for i in range(repeats)]
    part = {m: _share(r["participation"]) for m, r in runs.items()}
    res = {
        "config": cfg.to_dict(), "dataset": split.name, "repeats": repeats, "target_accuracy": target,
        "target_rule": "median of the serialized baseline's accuracy over its last third of rounds "
                       "(all repeats), floored to a point",
        "time_to_target_s": tt, "time_to_target_s_each": tt_each, "final_accuracy": final,
        "final_accuracy_each": {m: [r[m]["curve"].final for r in reps] for m in runs}, "participation": part,
        "speedup_vs_serialized": speedups.get(best), "speedup_method": best, "speedups": speedups,
        "speedup_each_repeat": [e.get(best) for e in each] if best else [],
        "time_to_target_with_startup_s": {m: None if tt[m] is None else tt[m] + median(
            r[m]["startup_s"] for r in reps) for m in runs},
        "startup_s": {m: median(r[m]["startup_s"] for r in reps) for m in GCPSL},
        "train_s": {m: median(r[m]["curve"].points[-1][1] for r in reps) for m in runs},
        "dropped_client_rounds": {m: r["participation"]["dropped_client_rounds"] for m, r in runs.items()},
        "curves": {m: r["curve"].points for m, r in runs.items()},
    }
    res["goals"] = {
        "speedup_ge_3x": best is not None and speedups[best] >= SPEEDUP_GOAL,
        "within_1pt_of_serialized": best is not None and final[best] >= final["serialized"] - ACCURACY_SLACK,
        "size_balanced_participation_gt_random": part["gcpsl-size"]["samples"] > part["gcpsl-random"]["samples"],
    }
    if with_fault:
        _add_fault(res, split, cfg, work, runs, target)
    return res


def _add_fault(res: dict, split, cfg: SplitConfig, work: Path, runs: dict, target: float) -> None:
    res["fault"] = fault = fault_run(split, cfg, work, runs["gcpsl-label"])
    ref = fault.pop("reference_curve")
    tt = res["time_to_target_s"]
    # where the speedup comes from: batches + global sampling (GPSL, one process) and parallel
    # clusters (the same GCPSL rounds, clusters one after another in one process)
    res["one_process_gcpsl_label"] = {"time_to_target_s": ref.time_to(target), "final_accuracy": ref.final,
                                      "train_s": ref.points[-1][1]}
    res["decomposition"] = {
        "gpsl_one_process_vs_serialized": _ratio(tt["serialized"], tt["gpsl"]),
        "gcpsl_label_4_workers_vs_one_process": _ratio(ref.time_to(target), tt["gcpsl-label"]),
        "gcpsl_label_one_process_vs_serialized": _ratio(tt["serialized"], ref.time_to(target))}


def table(res: dict) -> Table:
    t = Table(title=f"split learning, {res['dataset']}: target accuracy {res['target_accuracy']:.2f}")
    for col in ("method", "time to target (s)", "+ start-up (s)", "final acc", "clients", "samples", "speedup"):
        t.add_column(col)
    for m in METHODS:
        tt = res["time_to_target_s"][m]
        t.add_row(m, fmt(tt), fmt(res["time_to_target_with_startup_s"][m]), fmt(res["final_accuracy"][m], 4),
                  fmt(res["participation"][m]["clients"]), fmt(res["participation"][m]["samples"]),
                  fmt(res["speedups"].get(m)))
    g = res["goals"]
    each = ", ".join(fmt(x) for x in res["speedup_each_repeat"])
    t.caption = (f"best GCPSL {res['speedup_method']}: {fmt(res['speedup_vs_serialized'])}x, median of "
                 f"{res['repeats']} (each: {each}; goal >= 3: "
                 f"{goal(g['speedup_ge_3x'])}); within 1 pt of serialized: {goal(g['within_1pt_of_serialized'])}; "
                 f"size-balanced participation > random: {goal(g['size_balanced_participation_gt_random'])}")
    return t


def plot(res: dict, path: Path) -> None:
    from unbroken.figures import plt, save_png

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, pts in res["curves"].items():
        ax.plot([p[1] for p in pts], [p[2] for p in pts], label=m, lw=1.4)
    ax.axhline(res["target_accuracy"], color="grey", ls="--", lw=1, label=f"target {res['target_accuracy']:.2f}")
    ax.set_xlabel("training wall time (s, evaluation excluded)")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"{res['dataset']}, {res['config']['clients']} clients, {res['config']['clusters']} workers")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_png(fig, path)
    plt.close(fig)


def split(quick: bool = typer.Option(False, "--quick", help="smoke run: digits, 32 clients, no fault run"),
          epochs: float = typer.Option(2.0, "--epochs", help="sample budget of every method"),
          repeats: int = typer.Option(REPEATS, "--repeats", min=1, help="every method this many times, "
                                      "interleaved; times to target are the medians"),
          out: Path = typer.Option(RESULTS_DIR, "--out", help="directory for split.json and split.png")) -> None:
    """GCPSL vs serialized / PSL / GPSL: time to target, accuracy, participation; a killed cluster worker."""
    cfg = (SplitConfig(dataset="digits", clients=32, batch=16, merge_every=4, hidden=64, epochs=epochs,
                       p_drop=P_DROP) if quick else SplitConfig(epochs=epochs, p_drop=P_DROP))
    with tempfile.TemporaryDirectory(prefix="bench-split-") as tmp:
        res = measure(cfg, Path(tmp), with_fault=not quick, repeats=1 if quick else repeats)
    console = Console()
    console.print(table(res))
    if "fault" in res:
        console.print(res["fault"])
        console.print({"one_process_gcpsl_label": res["one_process_gcpsl_label"], **res["decomposition"]})
    path = write_result("split", res, out)
    plot(res, Path(out) / "split.png")
    console.print(f"wrote {path} and {Path(out) / 'split.png'}")
