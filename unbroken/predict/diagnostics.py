"""Why a held-out figure is what it is: per-GPU offsets, roofline efficiency, power given measured ITL.

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
