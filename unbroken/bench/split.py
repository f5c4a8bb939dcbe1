"""`unbroken bench split`: serialized, PSL, GPSL and GCPSL (random / size-balanced /
label-aware clusters, one `unbroken run` rank per cluster) on one non-IID split of
Fashion-MNIST across 256 logical clients, in one run: time to a target accuracy (the
serialized baseline's final accuracy, floored to a point, minus one point), final accuracy,
participation; then GCPSL with client dropouts and a cluster worker SIGKILLed mid-round,
checked bitwise against the failure-free run. Every method's clients drop out of a round
with probability 2%. Writes bench/results/split.json + split.png.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

from unbroken.bench.common import RESULTS_DIR, fmt, goal, write_result
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


def measure(cfg: SplitConfig, work: Path, *, with_fault: bool = True) -> dict:
    split = data.load(cfg.dataset, cfg.data_dir)
    runs = {m: _inprocess(m, split, cfg) for m in ("serialized", "psl", "gpsl")}
    runs.update({m: _cluster_job(m, split, cfg, work) for m in GCPSL})
    target = math.floor(100 * runs["serialized"]["curve"].final) / 100 - ACCURACY_SLACK
    tt = {m: r["curve"].time_to(target) for m, r in runs.items()}
    final = {m: r["curve"].final for m, r in runs.items()}
    speedups = {m: tt["serialized"] / tt[m] for m in GCPSL if tt[m] and tt["serialized"]}
    best = max(speedups, key=speedups.get) if speedups else None
    part = {m: _share(r["participation"]) for m, r in runs.items()}
    res = {
        "config": cfg.to_dict(), "dataset": split.name, "target_accuracy": target,
        "target_rule": "serialized final accuracy floored to a point, minus one point",
        "time_to_target_s": tt, "final_accuracy": final, "participation": part,
        "speedup_vs_serialized": speedups.get(best), "speedup_method": best, "speedups": speedups,
        "time_to_target_with_startup_s": {m: None if tt[m] is None else tt[m] + runs[m]["startup_s"] for m in runs},
        "startup_s": {m: runs[m]["startup_s"] for m in GCPSL},
        "train_s": {m: r["curve"].points[-1][1] for m, r in runs.items()},
        "dropped_client_rounds": {m: r["participation"]["dropped_client_rounds"] for m, r in runs.items()},
        "curves": {m: r["curve"].points for m, r in runs.items()},
    }
    res["goals"] = {
        "speedup_ge_3x": best is not None and speedups[best] >= SPEEDUP_GOAL,
        "within_1pt_of_serialized": best is not None and final[best] >= final["serialized"] - ACCURACY_SLACK,
        "size_balanced_participation_gt_random": part["gcpsl-size"]["samples"] > part["gcpsl-random"]["samples"],
    }
    if with_fault:
        res["fault"] = fault = fault_run(split, cfg, work, runs["gcpsl-label"])
        ref = fault.pop("reference_curve")
        # where the speedup comes from: batches + global sampling (GPSL, one process) and parallel
        # clusters (the same GCPSL rounds, clusters one after another in one process)
        res["one_process_gcpsl_label"] = {"time_to_target_s": ref.time_to(target), "final_accuracy": ref.final,
                                          "train_s": ref.points[-1][1]}
        res["decomposition"] = {
            "gpsl_one_process_vs_serialized": _ratio(tt["serialized"], tt["gpsl"]),
            "gcpsl_label_4_workers_vs_one_process": _ratio(ref.time_to(target), tt["gcpsl-label"]),
            "gcpsl_label_one_process_vs_serialized": _ratio(tt["serialized"], ref.time_to(target))}
    return res


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
    t.caption = (f"best GCPSL {res['speedup_method']}: {fmt(res['speedup_vs_serialized'])}x (goal >= 3: "
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
          out: Path = typer.Option(RESULTS_DIR, "--out", help="directory for split.json and split.png")) -> None:
    """GCPSL vs serialized / PSL / GPSL: time to target, accuracy, participation; a killed cluster worker."""
    cfg = (SplitConfig(dataset="digits", clients=32, batch=16, merge_every=4, hidden=64, epochs=epochs,
                       p_drop=P_DROP) if quick else SplitConfig(epochs=epochs, p_drop=P_DROP))
    with tempfile.TemporaryDirectory(prefix="bench-split-") as tmp:
        res = measure(cfg, Path(tmp), with_fault=not quick)
    console = Console()
    console.print(table(res))
    if "fault" in res:
        console.print(res["fault"])
        console.print({"one_process_gcpsl_label": res["one_process_gcpsl_label"], **res["decomposition"]})
    path = write_result("split", res, out)
    plot(res, Path(out) / "split.png")
    console.print(f"wrote {path} and {Path(out) / 'split.png'}")
