"""Held-out evaluation: 5-fold CV, leave-one-GPU-out, leave-one-LLM-out; MdAPE, Pearson r, Kendall τ, coverage.

Kendall τ follows WattGPU: for the GPU ranking, group the rows by (model, operating point),
average within each GPU, rank the GPUs by measured and by predicted value and average τ over
the groups with >= 2 GPUs; the model ranking swaps the roles.
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from unbroken.predict.baselines import roofline_itl, tdp_power
from unbroken.predict.dataset import Table
from unbroken.predict.models import DEFAULT, XgbConfig, fit, keep_shots, mdape
from unbroken.predict.siblings import Hardware

SPLITS = ("cv", "logo", "lolo")


class SplitError(ValueError):
    """A split cannot be made on this data (e.g. leave-one-GPU-out with a single GPU)."""


def splits(table: Table, kind: str, *, k: int = 5, seed: int = 0,
           shots: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, test) row indices per fold. Under LOGO and LOLO, `shots` > 0 moves that many rows of the
    held-out GPU or model, drawn at random (`seed`), into its training split: the few measurements a user
    makes of new hardware (`unbroken predict profile`) before asking for the rest; the test rows are the
    held-out group's other rows."""
    from sklearn.model_selection import KFold

    if kind == "cv" and shots:
        raise SplitError("shots apply to held-out groups (logo, lolo), not to cv's random folds")
    if kind == "cv":
        return list(KFold(n_splits=k, shuffle=True, random_state=seed).split(np.arange(len(table))))
    if kind not in ("logo", "lolo"):
        raise SplitError(f"split {kind!r} is not one of {', '.join(SPLITS)}")
    labels = table.gpu if kind == "logo" else table.model
    uniq = sorted(set(labels.tolist()))
    what = "GPU" if kind == "logo" else "model"
    if len(uniq) < 2:
        raise SplitError(f"{kind.upper()} needs at least 2 {what}s; this data has only {uniq or 'none'}, so "
                         f"every training split would be empty. Add measurements of another {what}")
    if shots < 0:
        raise SplitError(f"shots must be >= 0, got {shots}")
    rng = np.random.default_rng(seed)
    out = []
    for u in uniq:
        held = np.flatnonzero(labels == u)
        if shots and shots >= len(held):
            raise SplitError(f"{shots} shots of {what} {u!r} leave none of its {len(held)} rows to test; "
                             f"use fewer shots")
        out.append(keep_shots(np.flatnonzero(labels != u), held, labels, shots, rng))
    return out


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 2 or np.std(a[ok]) == 0 or np.std(b[ok]) == 0:
        return math.nan
    return float(np.corrcoef(a[ok], b[ok])[0, 1])


def _config_key(row) -> tuple:
    return (row.n_gpus, round(math.log2(row.batch)), row.prompt_tokens if not math.isnan(row.prompt_tokens) else -1,
            row.scenario, row.framework)


def kendall(table: Table, true: np.ndarray, pred: np.ndarray, rank_over: str) -> float:
    """Mean Kendall τ of the ranking of `rank_over` ("gpu" or "model") within each group of the other."""
    from scipy.stats import kendalltau

    cells: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for i, row in enumerate(table.rows):
        entity = row.gpu if rank_over == "gpu" else row.model
        group = ((row.model if rank_over == "gpu" else row.gpu),) + _config_key(row)
        if np.isfinite(true[i]) and np.isfinite(pred[i]):
            cells[group][entity].append((true[i], pred[i]))
    taus = []
    for ents in cells.values():
        if len(ents) < 2:
            continue
        t = [np.mean([p[0] for p in v]) for v in ents.values()]
        p = [np.mean([p[1] for p in v]) for v in ents.values()]
        tau = kendalltau(t, p).statistic
        if np.isfinite(tau):
            taus.append(tau)
    return float(np.mean(taus)) if taus else math.nan


def per_group_mdape(labels: np.ndarray, pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    return {u: round(mdape(pred[labels == u], true[labels == u]), 3) for u in sorted(set(labels.tolist()))}


def per_group_pearson(labels: np.ndarray, pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """Pearson r within each group (NaN where the group has < 2 rows or no spread)."""
    return {u: round(pearson(pred[labels == u], true[labels == u]), 4) for u in sorted(set(labels.tolist()))}


INNER_FOLDS = 3       # inner folds of the nested search under CV and LOLO
MAX_INNER_LOGO = 8    # under LOGO: one inner fold per training GPU, up to this many


def inner_k(kind: str, train_groups: np.ndarray | None, default: int = INNER_FOLDS) -> int:
    """How many inner folds the nested search uses in one outer split. Under LOGO, one per training
    GPU (inner leave-one-GPU-out: the outer task in miniature, so the search scores each candidate
    on the extrapolation it will face; with 3 grouped folds it scored on folds holding out 2-3 GPUs
    at once and chose worse, see docs/predict.md), at most MAX_INNER_LOGO; else `default`."""
    if kind not in SPLITS:
        raise SplitError(f"split {kind!r} is not one of {', '.join(SPLITS)}")
    if default < 2:
        raise ValueError(f"inner folds must be >= 2, got {default}")
    n_groups = 0 if train_groups is None else len(set(train_groups.tolist()))
    if kind != "logo" or n_groups < 2:  # one training GPU: row folds, as before (no group to hold out)
        return default
    return min(n_groups, MAX_INNER_LOGO)


def predict_held_out(table: Table, target: str, kind: str, *, grid: tuple[XgbConfig, ...] = (DEFAULT,),
                     coverage: float = 0.9, k: int | None = None, balance: bool = True,
                     shots: int = 0, transfer: bool = True, framework_laws: bool = True) -> dict[str, np.ndarray]:
    """Out-of-split predictions for every row, in physical units (W per GPU or s): xgboost point,
    interval, baseline; plus the config each split chose (from `grid`, by inner folds of that
    split's training rows only; `k` of them, or `inner_k`'s choice when None) and whether every
    split's interval was calibrated on group folds. `balance`: every training GPU weighs the same
    in the fits (`models.balanced_weights`), however many rows it has. `shots`: see `splits`; the
    rows moved into training keep NaN predictions and are left out of every score, and
    `baseline_from_shots` is the baseline calibrated on those rows alone (what a user can do by hand
    with a few measurements: the roofline, or TDP, times the held-out group's own measured factor).
    `transfer`: the search may predict an unseen GPU's ITL from its measured sibling (`siblings`);
    `sibling` then names, per row, the GPU its prediction came from ("" for the trees alone);
    `framework_laws`: the search may also choose the transfer's law per serving framework."""
    n = len(table)
    out = {name: np.full(n, np.nan) for name in ("xgboost", "low", "high", "baseline", "baseline_from_shots")}
    out["sibling"] = np.full(n, "", dtype=object)
    chosen, grouped, ks = [], [], []
    inner_groups = {"cv": None, "logo": table.gpu, "lolo": table.model}[kind]
    scale = table.tdp_w if target == "power" else np.ones(n)
    y = table.target(target)
    hw = Hardware(table.gpu, table.maker)
    for tr, te in splits(table, kind, shots=shots):
        g_tr = None if inner_groups is None else inner_groups[tr]
        ks.append(k if k is not None else inner_k(kind, g_tr))
        p = fit(table.X[tr], y[tr], target, groups=g_tr, grid=grid, coverage=coverage, k=ks[-1],
                categories=table.category()[tr], balance=table.gpu[tr] if balance else None, shots=shots,
                hardware=hw.take(tr) if transfer else None, framework_laws=framework_laws)
        point, lo, hi, via = p.predict_via(table.X[te], table.category()[te], makers=table.maker[te])
        out["sibling"][te] = [s or "" for s in via]
        out["xgboost"][te], out["low"][te], out["high"][te] = point * scale[te], lo * scale[te], hi * scale[te]
        base = tdp_power if target == "power" else roofline_itl
        out["baseline"][te] = base(table.subset(tr), table.subset(te))
        if shots:
            held = tr[np.isin(inner_groups[tr], inner_groups[te])]
            out["baseline_from_shots"][te] = base(table.subset(held), table.subset(te))
        chosen.append(p.config)
        grouped.append(p.grouped)
    out["configs"] = chosen
    out["grouped"] = all(grouped)
    out["inner_folds"] = ks
    return out


def _interval(preds: dict, true: np.ndarray, rows: np.ndarray) -> dict:
    """Coverage and median relative width of the interval over `rows` (a mask)."""
    inside = (true[rows] >= preds["low"][rows]) & (true[rows] <= preds["high"][rows])
    width = (preds["high"][rows] - preds["low"][rows]) / preds["xgboost"][rows]
    return {"coverage": round(float(inside.mean()), 4) if rows.any() else math.nan,
            "interval_median_width_pct": round(float(np.median(width)) * 100, 2) if rows.any() else math.nan}


def by_source(preds: dict, true: np.ndarray) -> dict:
    """MdAPE, coverage and width apart for the rows whose ITL came from a sibling and those the trees
    predicted (one interval calibration serves both: docs/predict.md says why)."""
    scored = np.isfinite(preds["xgboost"])
    out = {}
    for name, rows in (("sibling", preds["sibling"] != ""), ("trees", preds["sibling"] == "")):
        rows = scored & rows
        out[name] = {"rows": int(rows.sum()), "mdape": round(mdape(preds["xgboost"][rows], true[rows]), 3),
                     **_interval(preds, true, rows)}
    return out


def headline(table: Table, target: str, preds: dict) -> dict:
    """The figures every held-out run reports: MdAPE of xgboost and the baseline (pooled and per
    GPU), their ratio, the interval's coverage and width, and the figures per source of the ITL."""
    true = table.power_w if target == "power" else table.itl_s
    res = {"n_rows": len(table), "n_gpus": len(set(table.gpu.tolist())), "n_models": len(set(table.model.tolist())),
           "mdape": {name: round(mdape(preds[name], true), 3) for name in ("xgboost", "baseline")}}
    res.update(_interval(preds, true, np.isfinite(preds["xgboost"])))  # rows a split predicted
    if "sibling" in preds and (preds["sibling"] != "").any():
        res["by_source"] = by_source(preds, true)
    res["mdape_per_gpu"] = {n: per_group_mdape(table.gpu, preds[n], true) for n in ("xgboost", "baseline")}
    res["baseline_over_xgboost"] = round(res["mdape"]["baseline"] / res["mdape"]["xgboost"], 3) \
        if res["mdape"]["xgboost"] > 0 else None
    return res


def score(table: Table, target: str, preds: dict) -> dict:
    """The metrics for one (data set, split, target): `headline`, and Pearson r and Kendall tau
    (pooled, per GPU and per model) and MdAPE per model, xgboost next to the baseline."""
    true = table.power_w if target == "power" else table.itl_s
    res = headline(table, target, preds)
    names = ("xgboost", "baseline")
    res["pearson_r"] = {n: round(pearson(preds[n], true), 4) for n in names}
    res["kendall_tau_gpu"] = {n: round(kendall(table, true, preds[n], "gpu"), 4) for n in names}
    res["kendall_tau_model"] = {n: round(kendall(table, true, preds[n], "model"), 4) for n in names}
    res["mdape_per_model"] = {n: per_group_mdape(table.model, preds[n], true) for n in names}
    res["pearson_r_per_gpu"] = {n: per_group_pearson(table.gpu, preds[n], true) for n in names}
    res["pearson_r_per_model"] = {n: per_group_pearson(table.model, preds[n], true) for n in names}
    return res
