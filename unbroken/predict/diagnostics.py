"""Why a held-out figure is what it is: per-GPU offsets, roofline efficiency, power given measured ITL,
the sibling transfer in hindsight.

These read the held-out rows' measurements on purpose (they are diagnostics, never
predictions): the offset of a held-out GPU is the median of measured ÷ predicted over its
rows, i.e. how far that GPU's level lies from what the other GPUs imply; dividing it out
leaves the error in the *shape* (how the target moves with model, batch and length). A
spec-only model can reach a LOGO MdAPE goal only if both are within the goal.
"""
from __future__ import annotations

import numpy as np

from unbroken.predict.dataset import Table
from unbroken.predict.evaluate import splits
from unbroken.predict.features import FEATURES, FRAMEWORKS, ROOFLINE
from unbroken.predict.models import XgbConfig, balanced_weights, fit_xgb, mdape
from unbroken.predict.siblings import Hardware, Law, log_speedup, nearest, parts


def gpu_offsets(table: Table, true: np.ndarray, pred: np.ndarray) -> dict:
    """Per held-out GPU: its offset (median measured/predicted), MdAPE as predicted and after the
    offset is divided out; and the pooled MdAPE after the per-GPU offsets."""
    per, corrected = {}, np.full(len(true), np.nan)
    for g in sorted(set(table.gpu.tolist())):
        sel = (table.gpu == g) & np.isfinite(pred) & np.isfinite(true) & (pred > 0)
        if not sel.any():
            continue
        off = float(np.exp(np.median(np.log(true[sel] / pred[sel]))))
        corrected[sel] = pred[sel] * off
        per[g] = {"offset": round(off, 4), "mdape": round(mdape(pred[sel], true[sel]), 3),
                  "mdape_after_offset": round(mdape(corrected[sel], true[sel]), 3), "rows": int(sel.sum())}
    return {"per_gpu": per, "mdape_after_offsets": round(mdape(corrected, true), 3)}


def roofline_efficiency(table: Table) -> dict:
    """Median measured ITL ÷ per-token roofline for each (GPU, framework): how far each software
    stack on each accelerator stays above its physical floor, and the IQR of that factor."""
    fw_codes = table.X[:, FEATURES.index("framework")]
    frameworks = {float(i): f for i, f in enumerate(FRAMEWORKS)}
    ratio = table.itl_s / np.exp(table.X[:, ROOFLINE])
    out: dict = {}
    for g in sorted(set(table.gpu.tolist())):
        for code in sorted(set(fw_codes[table.gpu == g].tolist())):
            sel = (table.gpu == g) & (fw_codes == code) & np.isfinite(ratio)
            if sel.any():
                q25, q50, q75 = np.percentile(ratio[sel], [25, 50, 75])
                out.setdefault(g, {})[frameworks.get(code, "unknown")] = {
                    "median": round(float(q50), 3), "iqr": [round(float(q25), 3), round(float(q75), 3)],
                    "rows": int(sel.sum())}
    return out


def power_given_measured_itl(table: Table, kind: str, cfg: XgbConfig, balance: bool = True) -> dict:
    """Held-out (`kind`: logo or lolo) power MdAPE when the model is also handed each row's
    *measured* ITL and the achieved fraction of the roofline (information no prediction for an
    unseen GPU or model has): an optimistic bound on any power model built on an ITL prediction.
    `balance`: the GPU-balanced weights the predictors themselves use (`models.balanced_weights`)."""
    extra = np.column_stack([np.log(table.itl_s), table.X[:, ROOFLINE] - np.log(table.itl_s)])
    X, y = np.hstack([table.X, extra]), table.target("power")
    pred = np.full(len(y), np.nan)
    for tr, te in splits(table, kind):
        w = balanced_weights(table.gpu[tr]) if balance else None
        pred[te] = np.maximum(fit_xgb(X[tr], y[tr], cfg, w).predict(X[te]), 1e-4)
    watts, true = pred * table.tdp_w, table.power_w
    labels = table.gpu if kind == "logo" else table.model
    return {"mdape": round(mdape(watts, true), 3),
            f"mdape_per_{'gpu' if kind == 'logo' else 'model'}": {
                u: round(mdape(watts[labels == u], true[labels == u]), 3) for u in sorted(set(labels.tolist()))}}


# the laws the hindsight diagnostic tries (`siblings.Law`), by kind, and the name of each kind's parameter
HINDSIGHT_LAWS = {"ratio": tuple(Law("ratio", a / 4) for a in range(7)),     # alpha 0, 0.25, ..., 1.5
                  "offset": tuple(Law("offset", c / 4) for c in range(13)),  # c 0, 0.25, ..., 3
                  "specs": tuple(Law("specs", a / 4, b / 4) for a in range(7) for b in range(7))}
_PARAMETER = {"ratio": "alpha", "offset": "c", "specs": "exponents"}  # specs: [bandwidth, TFLOPS]
_FW, _SC = FEATURES.index("framework"), FEATURES.index("scenario")


def _setup_key(row) -> tuple:
    """A configuration as two GPUs can share it: model, GPUs per replica, batch and lengths (on a
    log2 grid: ML.ENERGY 2023 reports each GPU's own mean output length), scenario, framework."""
    def log2(v: float) -> int:
        return -1 if not v > 0 else round(float(np.log2(v)))
    return (row.model, row.n_gpus, log2(row.batch), log2(row.prompt_tokens), log2(row.output_tokens),
            row.scenario, row.framework)


def _pairs(table: Table, known: dict, cells: dict, gpu: str, leave_out: str | None = None) -> dict[str, list]:
    """Per serving framework, the configurations `gpu` shares with a same-maker part (its nearest one
    that ran each, `leave_out` excepted): (ITL measured on `gpu`, ITL measured on that part, log
    roofline on `gpu`, log roofline there, that part's efficiency in the setup, log bandwidth and log
    TFLOPS of `gpu` over that part)."""
    me, out = known[gpu], {}
    for key, on in cells.items():
        there = [known[s] for s in on if s not in (gpu, leave_out) and me.maker and known[s].maker == me.maker] \
            if gpu in on else []
        if there:  # the transfer's rule (siblings.nearest) among the parts that ran this configuration
            sib = nearest(there, np.asarray(me.figures))
            here, far = on[gpu], on[sib.name]
            setup = (float(table.X[far[0], _FW]), float(table.X[far[0], _SC]))
            out.setdefault(key[-1], []).append((np.median(table.itl_s[here]), np.median(table.itl_s[far]),
                                                np.log(np.median(table.roofline_s[here])),
                                                np.log(np.median(table.roofline_s[far])), sib.efficiency_of(setup),
                                                *log_speedup(me.figures, sib.figures)))
    return out


def _errors(cases: list, law: Law) -> np.ndarray:
    true, itl, here, there, k, bw, tf = map(np.array, zip(*cases))
    return np.abs(law.apply(itl, here, there, k, (bw, tf)) / true - 1)


def _best(cases: list, laws: tuple[Law, ...]) -> Law:
    return min(laws, key=lambda a: float(np.median(_errors(cases, a))))


def sibling_hindsight(table: Table) -> dict:
    """ITL LOGO with the sibling transfer read off *measured* ITL: each held-out GPU's configuration is
    predicted from its nearest same-maker part's measurement of that configuration (not the trees'
    estimate) by a transfer law per serving framework (`siblings.Law`; the ratio law's alpha at the
    top level, the offset law's c under "offset", the specs law's two exponents under "specs"),
    chosen two ways: `hindsight`, the law best for that GPU and framework (what the transfer cannot
    beat however well the trees fit the sibling and the search picks the law); `from_other_gpus`,
    the law best over the other GPUs' pairs of that framework (the held-out GPU neither target nor
    sibling): whether a pair's law carries over to another pair. Configurations no sibling ran are not scored."""
    known = {p.name: p for p in parts(table.X, Hardware(table.gpu, table.maker), table.itl_s)}
    cells: dict[tuple, dict[str, list[int]]] = {}
    for i, row in enumerate(table.rows):
        cells.setdefault(_setup_key(row), {}).setdefault(str(table.gpu[i]), []).append(i)
    per, pooled = {}, {(kind, how): [] for kind in HINDSIGHT_LAWS for how in ("hindsight", "from_other_gpus")}
    for g in sorted(known):
        mine = _pairs(table, known, cells, g)
        if not mine:
            continue
        per[g] = {"configurations": sum(map(len, mine.values()))}
        theirs = [_pairs(table, known, cells, h, g) for h in known if h != g]
        for kind, how in pooled:
            pooled[(kind, how)].append(_choose(mine, theirs, HINDSIGHT_LAWS[kind], how, per[g], kind))
    out = {"per_gpu": per, "configurations": sum(v["configurations"] for v in per.values())}
    for (kind, how), errs in pooled.items():
        (out if kind == "ratio" else out.setdefault(kind, {}))[how] = {
            "mdape": _pct(np.concatenate(errs)) if errs else None}
    return out


def _choose(mine: dict, theirs: list, laws: tuple[Law, ...], how: str, record: dict, kind: str) -> np.ndarray:
    """One held-out GPU's errors with each framework's law chosen `how`; the laws and MdAPE go into
    `record` (under the law's kind, but for the ratio law's)."""
    chosen, errs = {}, []
    for fw, cases in sorted(mine.items()):
        others = [c for pairs in theirs for c in pairs.get(fw, [])]
        chosen[fw] = _best(cases, laws) if how == "hindsight" else (_best(others, laws) if others else None)
        errs.append(_errors(cases, chosen[fw]) if chosen[fw] is not None else np.full(len(cases), np.nan))
    out = np.concatenate(errs)
    where = record if kind == "ratio" else record.setdefault(kind, {})
    where[how] = {_PARAMETER[kind]: {fw: _parameter(a) for fw, a in chosen.items()},
                  "mdape": _pct(out)}
    return out


def _parameter(law: Law | None) -> float | list[float] | None:
    return None if law is None else [law.value, law.compute] if law.kind == "specs" else law.value


def _pct(errors: np.ndarray) -> float | None:
    """Median of relative errors in percent; None where none was scored (JSON has no NaN)."""
    ok = errors[np.isfinite(errors)]
    return round(float(np.median(ok)) * 100, 3) if ok.size else None
