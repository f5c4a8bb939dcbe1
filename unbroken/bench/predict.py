"""`unbroken bench predict`: power and ITL predictions on public measurements, held out three ways.

For each data set and target: 5-fold CV, leave-one-GPU-out and leave-one-LLM-out, XGBoost
next to its baseline (load-scaled TDP for power, calibrated roofline for ITL): MdAPE,
Pearson r, Kendall τ of the GPU and of the model rankings, per-GPU and per-model MdAPE, and
the coverage of the 90% conformal interval. The search (target form × hyperparameters) is nested:
inside every outer training split, inner folds grouped like the split (leave-one-GPU-out under
LOGO, 3 folds of models under LOLO) choose it, so a held-out GPU or model never influences its own model. Under
LOGO and LOLO it also records the diagnostics of `unbroken.predict.diagnostics`. Writes
bench/results/predict.json and predict.png.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table as RichTable

from unbroken.bench.common import RESULTS_DIR, goal, write_result
from unbroken.predict import diagnostics, evaluate, measurements, tables
from unbroken.predict.dataset import Table, build
from unbroken.predict.models import DEFAULT, SEARCH_GRID, mdape

# frameworks LLM-Inference-Bench ran on more than one accelerator: leaving a GPU out then never
# leaves its serving framework out too (Gaudi2 ran only DeepSpeed, SN40L only SambaFlow)
SHARED_FRAMEWORKS = ("vLLM", "llama.cpp", "TensorRT-LLM")

# (name in the JSON, data sets pooled, targets, frameworks kept or None for all); ml-energy-all
# pools both ML.ENERGY sets for power: 4 GPUs instead of 2 or 3 for leave-one-GPU-out
EVALS = (
    ("ml-energy", ("ml-energy",), ("power", "itl"), None),
    ("ml-energy-legacy", ("ml-energy-legacy",), ("power", "itl"), None),
    ("ml-energy-all", ("ml-energy", "ml-energy-legacy"), ("power",), None),
    ("llm-inference-bench", ("llm-inference-bench",), ("itl",), None),
    ("llm-inference-bench-shared-frameworks", ("llm-inference-bench",), ("itl",), SHARED_FRAMEWORKS),
)
COVERAGE = 0.9


def _table(sources: tuple[str, ...], frameworks: tuple[str, ...] | None = None) -> Table:
    rows = [m for s in sources for m in measurements.load(s) if frameworks is None or m.framework in frameworks]
    return build(rows, tables.load_gpus(), tables.load_models())


def _run_one(table: Table, target: str, grid, console: Console, balance: bool = True, transfer: bool = True,
             framework_laws: bool = True) -> dict:
    out = {}
    for kind in evaluate.SPLITS:
        t0 = time.monotonic()
        preds = evaluate.predict_held_out(table, target, kind, grid=grid, coverage=COVERAGE, balance=balance,
                                          transfer=transfer, framework_laws=framework_laws)
        res = evaluate.score(table, target, preds)
        chosen = Counter(preds["configs"]).most_common(1)[0][0]
        res["config"] = asdict(chosen)  # the one the outer splits chose most often
        res["configs_chosen"] = [asdict(c) for c in preds["configs"]]
        res["interval_group_calibrated"] = preds["grouped"]
        res["inner_folds"] = preds["inner_folds"]  # per outer split: LOGO holds one training GPU out per fold
        if kind == "logo":  # held-out GPU -> {the measured GPU its ITL came from ("" = the trees): rows}
            res["siblings_used"] = _siblings_used(table.gpu, preds["sibling"])
        if kind != "cv":
            res["diagnostics"] = _diagnostics(table, target, kind, preds["xgboost"], chosen, balance)
        res["seconds"] = round(time.monotonic() - t0, 1)
        out[kind] = res
        console.print(f"  {target:5s} {kind:4s} MdAPE xgboost {res['mdape']['xgboost']:7.2f}%  baseline "
                      f"{res['mdape']['baseline']:7.2f}%  coverage {res['coverage']:.2f}  ({res['seconds']} s)")
    return out


def _siblings_used(gpus: np.ndarray, sibling: np.ndarray) -> dict:
    return {g: dict(Counter(sibling[gpus == g].tolist())) for g in sorted(set(gpus.tolist()))}


SHOTS = (1, 5, 20)  # measured rows of the held-out GPU handed to its training split (few-shot LOGO)


def _few_shot(table: Table, target: str, grid, shots: tuple[int, ...], balance: bool, console: Console,
              transfer: bool = True, framework_laws: bool = True) -> dict:
    """LOGO with `n` random rows of each held-out GPU in its training split, for each n in `shots`:
    how many measurements of new hardware (`unbroken predict profile`) bring its other rows in."""
    out = {}
    for n in shots:
        t0 = time.monotonic()
        try:
            preds = evaluate.predict_held_out(table, target, "logo", grid=grid, coverage=COVERAGE, balance=balance,
                                              shots=n, transfer=transfer, framework_laws=framework_laws)
        except evaluate.SplitError as e:  # a GPU with <= n rows: say so in the record, go on
            out[str(n)] = {"skipped": str(e)}
            continue
        res = evaluate.headline(table, target, preds)  # few-shot reports no correlations
        true = table.power_w if target == "power" else table.itl_s
        from_shots = round(mdape(preds["baseline_from_shots"], true), 3)
        out[str(n)] = {"mdape": {**res["mdape"], "baseline_from_shots": from_shots},
                       "baseline_over_xgboost": res["baseline_over_xgboost"],
                       "coverage": res["coverage"], "interval_median_width_pct": res["interval_median_width_pct"],
                       "mdape_per_gpu": res["mdape_per_gpu"]["xgboost"],
                       "target_forms": dict(Counter(c.target_form for c in preds["configs"])),
                       "configs_chosen": [asdict(c) for c in preds["configs"]],  # incl. the transfer law and seen mode
                       "siblings_used": _siblings_used(table.gpu, preds["sibling"]),
                       **({"by_source": res["by_source"]} if "by_source" in res else {}),
                       "seconds": round(time.monotonic() - t0, 1)}
        console.print(f"  {target:5s} logo with {n:2d} shot(s) MdAPE xgboost {res['mdape']['xgboost']:7.2f}%  "
                      f"baseline {res['mdape']['baseline']:7.2f}%, from the shots "
                      f"{out[str(n)]['mdape']['baseline_from_shots']:7.2f}%  ({out[str(n)]['seconds']} s)")
    return out


def _shot_counts(text: str) -> tuple[int, ...]:
    """--shots: positive whole numbers separated by commas; '' for none."""
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        counts = None
    if counts is None or any(n < 1 for n in counts):
        from unbroken.cli_error import fail
        fail(f"--shots {text!r}: give positive whole numbers separated by commas, e.g. --shots 1,5,20")
    return counts


def _diagnostics(table: Table, target: str, kind: str, pred, cfg, balance: bool = True) -> dict:
    """LOGO: per-GPU offsets and (ITL) roofline efficiency and the sibling transfer in hindsight; power, LOGO and LOLO: the bound given measured ITL."""
    d = {}
    if kind == "logo":
        d["gpu_offsets"] = diagnostics.gpu_offsets(table, table.power_w if target == "power" else table.itl_s, pred)
        if target == "itl":
            d["roofline_efficiency"] = diagnostics.roofline_efficiency(table)
            d["sibling_hindsight"] = diagnostics.sibling_hindsight(table)
    if target == "power":
        d["power_given_measured_itl"] = diagnostics.power_given_measured_itl(table, kind, replace(cfg, target_form="direct"),
                                                                             balance)
    return d


def goals(results: dict) -> dict:
    """The issue's goals, each from the numbers above."""
    beat = {}
    for ds, per_split in results.items():
        for kind in ("logo", "lolo"):
            for target, r in per_split.get(kind, {}).items():
                beat[f"{ds}/{kind}/{target}"] = r["baseline_over_xgboost"]
    logo_power = {ds: results[ds]["logo"]["power"]["mdape"]["xgboost"]
                  for ds in ("ml-energy", "ml-energy-legacy", "ml-energy-all") if "power" in results.get(ds, {}).get("logo", {})}
    itl_bench = {ds: results[ds]["logo"]["itl"]["mdape"]["xgboost"] for ds in
                 ("llm-inference-bench", "llm-inference-bench-shared-frameworks") if ds in results}
    return {
        "baseline_over_xgboost_logo_lolo": beat,
        "beat_baseline_3x_logo_lolo": all(v is not None and v >= 3 for v in beat.values()) if beat else None,
        "power_logo_mdape_by_dataset": logo_power,
        "power_logo_le_5pct_ml_energy": (logo_power.get("ml-energy") is not None and logo_power["ml-energy"] <= 5)
        if logo_power else None,
        "itl_logo_mdape_llm_inference_bench": itl_bench,
        "itl_logo_le_10pct_llm_inference_bench": (itl_bench["llm-inference-bench"] <= 10)
        if "llm-inference-bench" in itl_bench else None,
    }


def _figure(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from unbroken.figures import save_png

    labels, xg, base = [], [], []
    for ds, per_split in results.items():
        for kind, per_target in per_split.items():
            for target, r in per_target.items():
                labels.append(f"{ds}\n{target} {kind}")
                xg.append(r["mdape"]["xgboost"])
                base.append(r["mdape"]["baseline"])
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.7), 4.5))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], xg, width=0.4, label="XGBoost")
    ax.bar([i + 0.2 for i in x], base, width=0.4, label="baseline (TDP / roofline)")
    ax.set_xticks(list(x), labels, rotation=90, fontsize=7)
    ax.set_ylabel("MdAPE (%)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("held-out MdAPE: XGBoost vs baseline (log scale)")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def predict(out_dir: Path = typer.Option(RESULTS_DIR, "--out-dir", help="where predict.json and predict.png go"),
            search: bool = typer.Option(True, "--search/--no-search", help="the small hyperparameter search in CV"),
            trees: int = typer.Option(DEFAULT.n_estimators, "--trees", help="XGBoost trees (fewer: a faster, rougher run)"),
            only: str = typer.Option("", "--only", help="comma-separated evaluation names to run (default: all)"),
            seed: int = typer.Option(DEFAULT.seed, "--seed", help="XGBoost's row/column sampling seed (the spread "
                                     "over seeds is the noise floor of a held-out figure)"),
            balance: bool = typer.Option(True, "--balance/--no-balance", help="every training GPU weighs the "
                                         "same in the fits, however many rows it has (--no-balance: every row)"),
            transfer: bool = typer.Option(True, "--siblings/--no-siblings", help="offer the search the ITL of an "
                                          "unseen GPU by transfer from its measured sibling of the same manufacturer"),
            framework_laws: bool = typer.Option(True, "--framework-laws/--one-law", help="the search may "
                                                  "choose the transfer law (ratio alpha or offset c) per serving framework"),
            shots: str = typer.Option(",".join(map(str, SHOTS)), "--shots", help="comma-separated numbers of "
                                      "measured rows of the held-out GPU to add to its LOGO training split "
                                      "(few-shot LOGO; '' skips it)")) -> None:
    """Held-out MdAPE, r, τ and interval coverage of the power and ITL predictors vs their baselines."""
    console = Console()
    base_cfg = replace(DEFAULT, n_estimators=trees, seed=seed)
    grid = tuple(replace(c, seed=seed, n_estimators=max(1, c.n_estimators * trees // DEFAULT.n_estimators))
                 for c in SEARCH_GRID) if search else (base_cfg,)
    wanted = {s for s in only.split(",") if s}
    unknown = wanted - {e[0] for e in EVALS}
    if unknown:
        from unbroken.cli_error import fail
        fail(f"--only {','.join(sorted(unknown))}: not an evaluation; choose from {', '.join(e[0] for e in EVALS)}")
    shot_counts = _shot_counts(shots)
    results, configs, few_shot = {}, {}, {}
    for name, sources, targets, frameworks in EVALS:
        if wanted and name not in wanted:
            continue
        table = _table(sources, frameworks)
        console.print(f"[bold]{name}[/]: {len(table)} rows, {len(set(table.gpu.tolist()))} GPUs, "
                      f"{len(set(table.model.tolist()))} models")
        for target in targets:
            t = table.with_target(target)
            per_split = _run_one(t, target, grid, console, balance, transfer, framework_laws)
            configs[f"{name}/{target}"] = {kind: r["config"] for kind, r in per_split.items()}
            for kind, r in per_split.items():
                results.setdefault(name, {}).setdefault(kind, {})[target] = r
            if shot_counts:
                few_shot.setdefault(name, {})[target] = _few_shot(t, target, grid, shot_counts, balance, console,
                                                                  transfer, framework_laws)
    g = goals(results)
    _print(results, g, console)
    out_dir = Path(out_dir)
    path = write_result("predict", {"results": results, "goals": g, "chosen_configs": configs,
                                    "search_grid": [asdict(c) for c in grid], "interval_nominal_coverage": COVERAGE,
                                    "balanced_gpu_weights": balance, "sibling_transfer": transfer,
                                    "framework_laws": transfer and framework_laws,
                                    "few_shot_logo": few_shot},
                        out_dir)
    _figure(results, out_dir / "predict.png")
    console.print(f"wrote {path} and {out_dir / 'predict.png'}")


def _print(results: dict, g: dict, console: Console) -> None:
    t = RichTable(title="held-out MdAPE (%): XGBoost vs baseline")
    for col in ("data set", "target", "split", "xgboost", "baseline", "ratio", "r", "τ GPU", "τ model", "coverage"):
        t.add_column(col)
    for ds, per_split in results.items():
        for kind, per_target in per_split.items():
            for target, r in per_target.items():
                t.add_row(ds, target, kind, f"{r['mdape']['xgboost']:.2f}", f"{r['mdape']['baseline']:.2f}",
                          f"{r['baseline_over_xgboost']}", f"{r['pearson_r']['xgboost']}",
                          f"{r['kendall_tau_gpu']['xgboost']}", f"{r['kendall_tau_model']['xgboost']}",
                          f"{r['coverage']:.2f}")
    console.print(t)
    console.print(f"beat each baseline by >= 3x under LOGO and LOLO: {goal(g['beat_baseline_3x_logo_lolo'])}; "
                  f"power MdAPE <= 5% LOGO on ML.ENERGY: {goal(g['power_logo_le_5pct_ml_energy'])}; "
                  f"ITL MdAPE <= 10% LOGO on LLM-Inference-Bench: {goal(g['itl_logo_le_10pct_llm_inference_bench'])}")
