"""Predictions for a GPU and model nobody profiled: power, ITL, tokens/s, tokens/J, each with an interval.

The power model trains on every measurement with power (both ML.ENERGY sets and the user's
own), the ITL model on every measurement; both calibrate their intervals on folds grouped by
GPU, so the width reflects the error on a GPU the model has not seen. A GPU with training rows
(a public one, or the user's own via --measurements) gets the width calibrated on folds that keep
as many rows of each held-out GPU (models.measured_widths, at 1, 5, 20 and 100 rows): the error of a
GPU the model has seen that often, not of one it never saw. A GPU never measured takes its ITL from
its measured sibling of the same manufacturer when GPU-grouped folds chose to (`siblings`); a GPU
with rows is predicted in the seen mode (models.SEEN_MODES) its row-count level measured best.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from unbroken.fsutil import atomic_write_json

from unbroken.predict import measurements
from unbroken.predict.dataset import Table, build
from unbroken.predict.features import FEATURES, OperatingPoint, matrix, point_of
from unbroken.predict.models import DEFAULT, Predictor, Trees, XgbConfig, fit, forms_for, measured_widths
from unbroken.predict.siblings import LAWS, SIBLING_MIN_ROWS, Hardware, Part
from unbroken.predict.tables import GpuSpec, GpuTable, ModelSpec, ModelTable


@dataclass(frozen=True)
class Estimate:
    gpu: str
    model: str
    n_gpus: int
    batch: float
    power_w: tuple[float, float, float]       # per GPU: (point, low, high)
    itl_s: tuple[float, float, float]
    tokens_s: tuple[float, float, float]      # the replica's decode throughput
    tokens_per_j: tuple[float, float, float]
    usd_per_mtok: tuple[float, float, float] | None = None
    # ITL rows of the GPU in the training data (0: never measured); its intervals are calibrated for
    # 1, 5, 20 or 100 of them (models.SHOT_LEVELS), the most it has
    gpu_rows: int = 0
    # the measured GPU of the same manufacturer whose ITL, scaled by the rooflines (and, for a GPU
    # with rows in a sibling seen mode, by its own level), this GPU's is (siblings.py); None: the trees
    itl_sibling: str | None = None
    # token lengths given but read as unknown: no training row of the query's setup recorded them
    lengths_ignored: tuple[str, ...] = ()


LENGTHS = ("prompt_tokens", "output_tokens")


@dataclass
class Trained:
    power: Predictor
    itl: Predictor
    n_power_rows: int
    n_itl_rows: int
    # {(framework, scenario): the token lengths (LENGTHS) its training rows recorded}; a setup absent
    # here has no training rows
    lengths: dict[tuple[str, str], frozenset[str]] = field(default_factory=dict)

    def as_trained(self, op: OperatingPoint) -> tuple[OperatingPoint, tuple[str, ...]]:
        """`op` with the lengths its setup's training rows never recorded read as unknown, and their
        names. ML.ENERGY 2023's `transformers` rows have no prompt length: given one, the trees took a
        branch learned from other setups' rows, and the H200 check's 7B decode came out 9.2 ms instead
        of 21.9 (docs/predict.md). A setup with no training rows keeps what it was given."""
        known = self.lengths.get((op.framework, op.scenario))
        if known is None:
            return op, ()
        ignored = tuple(n for n in LENGTHS if not math.isnan(getattr(op, n)) and n not in known)
        return replace(op, **{n: math.nan for n in ignored}), ignored


def recorded_lengths(table: Table) -> dict[tuple[str, str], frozenset[str]]:
    """Per (framework, scenario) of `table`'s rows, the token lengths any of them recorded."""
    out: dict[tuple[str, str], set[str]] = {}
    for m in table.rows:
        out.setdefault((m.framework, m.scenario), set()).update(n for n in LENGTHS if not math.isnan(getattr(m, n)))
    return {k: frozenset(v) for k, v in out.items()}


def training_table(gpus: GpuTable, models: ModelTable, extra: list[measurements.Measurement] = ()) -> Table:
    rows = [m for d in measurements.DATASETS for m in measurements.load(d)] + list(extra)
    return build(rows, gpus, models)


def train(table: Table, *, coverage: float = 0.9, config: XgbConfig = DEFAULT, k: int = 5) -> Trained:
    """Both predictors; the ITL target form (direct or roofline ratio) and whether an unmeasured GPU's
    ITL comes from its sibling are chosen by GPU-grouped folds."""
    pw, it = table.with_target("power"), table.with_target("itl")
    forms = tuple(replace(config, target_form=f) for f in forms_for("itl"))
    fitted = []
    for t, target, grid in ((pw, "power", (config,)), (it, "itl", forms)):
        hw = Hardware(t.gpu, t.maker)
        p = fit(t.X, t.target(target), target, groups=t.gpu, grid=grid, coverage=coverage, k=k,
                categories=t.category(), balance=t.gpu, hardware=hw)
        fitted.append(measured_widths(p, t.X, t.target(target), t.gpu, k, t.category(), t.gpu, hw))
    return Trained(power=fitted[0], itl=fitted[1], n_power_rows=len(pw), n_itl_rows=len(it),
                   lengths=recorded_lengths(table))


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "unbroken"


# how train() fits, beyond its arguments: a cache made under another recipe is not reused
RECIPE = ("gpu-balanced-weights, few-shot widths and seen modes at 1/5/20/100 rows, sibling transfer and levels, "
          f"transfer laws {'/'.join(map(str, LAWS))} per framework, siblings per framework and scenario, "
          f"a sibling's ITL beyond its largest batch along its line in the batch, siblings of >= {SIBLING_MIN_ROWS} "
          "rows per setup, a mixture's decode reading every expert its batch routes to")


def _key(table: Table, coverage: float, config: XgbConfig, k: int) -> str:
    h = hashlib.sha256(RECIPE.encode())
    for a in (table.X, table.power_w, table.tdp_w, table.itl_s):
        h.update(np.ascontiguousarray(a).tobytes())
    h.update(json.dumps([coverage, asdict(config), k, table.gpu.tolist(), table.maker.tolist()]).encode())
    return h.hexdigest()[:16]


def _save(p: Predictor, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{p.target}.{os.getpid()}.ubj"
    p.model.save_model(tmp)
    os.replace(tmp, folder / f"{p.target}.ubj")
    atomic_write_json(folder / f"{p.target}.json", {"config": asdict(p.config), "halfwidth": p.halfwidth,
                                                   "coverage": p.coverage, "by_category": p.by_category,
                                                   "grouped": p.grouped, "measured": p.measured,
                                                   "parts": [_part_to_json(q) for q in p.parts],
                                                   "gpu_levels": [[g, f, c] for (g, f), c in p.gpu_levels.items()]})


def _load(target: str, folder: Path) -> Predictor | None:
    import xgboost as xgb

    meta_path, model_path = folder / f"{target}.json", folder / f"{target}.ubj"
    if not (meta_path.is_file() and model_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
        booster = xgb.XGBRegressor()
        booster.load_model(model_path)
        model = Trees(booster)
    except (OSError, ValueError, xgb.core.XGBoostError):
        return None  # a damaged cache is retrained, not trusted
    return Predictor(target=target, model=model, config=XgbConfig(**meta["config"]), halfwidth=meta["halfwidth"],
                     coverage=meta["coverage"], by_category=_categories(meta["by_category"]),
                     grouped=bool(meta.get("grouped", False)), measured=_measured_from_json(meta.get("measured")),
                     parts=tuple(_part_from_json(q) for q in meta.get("parts", ())),
                     gpu_levels={(str(g), float(f)): float(c) for g, f, c in meta.get("gpu_levels", ())})


def _part_to_json(p: Part) -> dict:
    return {"name": p.name, "maker": p.maker, "figures": [None if math.isnan(v) else v for v in p.figures],
            "setups": sorted(p.setups), "efficiency": [list(e) for e in p.efficiency],
            "largest_batch": [list(b) for b in p.largest_batch]}


def _part_from_json(d: dict) -> Part:
    return Part(name=d["name"], maker=d["maker"], figures=tuple(math.nan if v is None else float(v) for v in d["figures"]),
                setups=frozenset((float(f), float(c)) for f, c in d["setups"]),
                efficiency=tuple((float(f), float(c), float(k)) for f, c, k in d.get("efficiency", ())),
                largest_batch=tuple((float(f), float(c), float(b))
                                    for f, c, b in d.get("largest_batch", ())))


def _categories(saved: dict) -> dict:
    """Per-category widths as saved (JSON keys are strings; categories are floats)."""
    return {float(c): q for c, q in saved.items()}


def _measured_from_json(m: dict | None) -> dict | None:
    """The measured-GPU widths as saved (JSON keys are strings: shot levels are ints)."""
    if not m:
        return None
    levels = {int(n): {"halfwidth": v["halfwidth"], "by_category": _categories(v["by_category"]),
                       "seen_mode": v.get("seen_mode", "trees")} for n, v in m["levels"].items()}
    return {"levels": levels, "rows": {str(g): int(n) for g, n in m["rows"].items()}}


def train_cached(table: Table, *, coverage: float = 0.9, config: XgbConfig = DEFAULT, k: int = 5,
                 root: Path | None = None) -> Trained:
    """train(), saved under the cache keyed by the training data and settings, reused when they match."""
    folder = (root or cache_dir()) / f"predict-{_key(table, coverage, config, k)}"
    power, itl = _load("power", folder), _load("itl", folder)
    pw, it = len(table.with_target("power")), len(table.with_target("itl"))
    if power is not None and itl is not None:
        return Trained(power=power, itl=itl, n_power_rows=pw, n_itl_rows=it, lengths=recorded_lengths(table))
    trained = train(table, coverage=coverage, config=config, k=k)
    _save(trained.power, folder)
    _save(trained.itl, folder)
    return trained


def estimate(trained: Trained, gpu: GpuSpec, model: ModelSpec, op: OperatingPoint,
             usd_per_gpu_hour: float | None = None) -> Estimate:
    op, ignored = trained.as_trained(op)
    X = matrix([(gpu, model, op)])
    cat = X[:, FEATURES.index("scenario")]
    power = trained.power.predict(X, cat, trained.power.rows_of(gpu.name))
    p, p_lo, p_hi = (float(v[0]) * gpu.thermal_design_power_w for v in power)
    rows, maker = trained.itl.rows_of(gpu.name), np.array([gpu.manufacturer])
    *itl, via = trained.itl.predict_via(X, cat, rows, maker)
    t, t_lo, t_hi = (float(v[0]) for v in itl)
    tok = (op.batch / t, op.batch / t_hi, op.batch / t_lo)
    per_j = (tok[0] / (p * op.n_gpus), tok[1] / (p_hi * op.n_gpus), tok[2] / (p_lo * op.n_gpus))
    cost = None
    if usd_per_gpu_hour is not None:
        usd_s = usd_per_gpu_hour * op.n_gpus / 3600.0
        cost = (usd_s / tok[0] * 1e6, usd_s / tok[2] * 1e6, usd_s / tok[1] * 1e6)
    return Estimate(gpu=gpu.name, model=model.name, n_gpus=op.n_gpus, batch=op.batch, power_w=(p, p_lo, p_hi),
                    itl_s=(t, t_lo, t_hi), tokens_s=tok, tokens_per_j=per_j, usd_per_mtok=cost,
                    gpu_rows=rows, itl_sibling=via[0], lengths_ignored=ignored)


def fits_in_memory(gpu: GpuSpec, model: ModelSpec, n_gpus: int) -> bool:
    """FP16 weights fit in the GPUs' memory (unknown memory: assume they do)."""
    return math.isnan(gpu.memory_size_gb) or 2.0 * model.total_b_params <= 0.9 * gpu.memory_size_gb * n_gpus


def rank(trained: Trained, gpus: GpuTable, model: ModelSpec, op: OperatingPoint,
         prices: dict[str, float] | None = None) -> list[Estimate]:
    """Every GPU in the tables whose memory holds the weights, best first: by cost when prices are
    given (GPUs without a price are left out), else by tokens/J. GPUs without a TDP cannot be ranked
    by energy and are left out."""
    out = []
    for g in gpus.specs:
        if math.isnan(g.thermal_design_power_w) or not fits_in_memory(g, model, op.n_gpus):
            continue
        if prices is not None and g.name not in prices:
            continue
        out.append(estimate(trained, g, model, op, None if prices is None else prices[g.name]))
    if prices is not None:
        return sorted(out, key=lambda e: e.usd_per_mtok[0])
    return sorted(out, key=lambda e: -e.tokens_per_j[0])


def as_dict(e: Estimate) -> dict:
    d = {"gpu": e.gpu, "model": e.model, "n_gpus": e.n_gpus, "batch": e.batch, "gpu_rows": e.gpu_rows,
         "itl_sibling": e.itl_sibling, "lengths_ignored": list(e.lengths_ignored)}
    for name in ("power_w", "itl_s", "tokens_s", "tokens_per_j", "usd_per_mtok"):
        v = getattr(e, name)
        if v is not None:
            d[name] = {"predicted": v[0], "low": v[1], "high": v[2]}
    return d


def check(trained: Trained, gpus: GpuTable, models: ModelTable, rows: list[measurements.Measurement]) -> dict:
    """Each measured row predicted: per-row error and interval hit, and per target MdAPE and coverage."""
    out, summary = [], {}
    for m in rows:
        e = estimate(trained, gpus.get(m.gpu), models.get(m.model), point_of(m))
        for target, measured, pred in (("power_w", m.power_w, e.power_w), ("itl_s", m.itl_s, e.itl_s)):
            if math.isnan(measured):
                continue
            out.append({"gpu": m.gpu, "model": m.model, "batch": m.batch, "scenario": m.scenario, "target": target,
                        "measured": measured, "predicted": pred[0], "low": pred[1], "high": pred[2],
                        "error": (pred[0] - measured) / measured, "inside": bool(pred[1] <= measured <= pred[2]),
                        "lengths_ignored": list(e.lengths_ignored)})
    for target in ("power_w", "itl_s"):
        hits = [r for r in out if r["target"] == target]
        if hits:
            summary[target] = {"n": len(hits), "mdape": float(np.median([abs(r["error"]) for r in hits])) * 100,
                               "coverage": sum(r["inside"] for r in hits) / len(hits)}
    return {"rows": out, "summary": summary}
