"""Confidence intervals of `unbroken bench collectives`' figures: a paired bootstrap over rounds.

A figure is the median, over cells (scenario x payload >= 1 MB), of the ratio of two methods' median
times in the cell (bench/collectives.py `_ratios`). The methods ran interleaved round by round, so a
resample keeps a round whole: the same round indices for both methods of a cell (a round that was
slow for everyone moves numerator and denominator alike), drawn independently per cell. RESAMPLES
resamples with a fixed SEED; the interval is bench/percentile.py's (widened to hold the point estimate).
"""
from __future__ import annotations

import numpy as np

from unbroken.bench.percentile import percentile_interval

RESAMPLES = 4000
SEED = 0
MB = 1 << 20


def figure_ci(rows: list[dict], scenarios: tuple[str, ...], num: str, den: str, *, level: float = 0.95,
              resamples: int = RESAMPLES, seed: int = SEED) -> list[float] | None:
    """The `level` interval of median over cells of median(num) / median(den); None without a cell."""
    by = {(r["scenario"], r["bytes"], r["method"]): r for r in rows}
    cells = [(sc, b) for sc, b, m in by if m == den and sc in scenarios and b >= MB and (sc, b, num) in by]
    if not cells:
        return None
    rng = np.random.default_rng(seed)
    ratios = np.empty((resamples, len(cells)))
    for k, (sc, b) in enumerate(cells):
        top, bottom = (np.asarray(by[(sc, b, m)]["seconds"], dtype=float) for m in (num, den))
        n = min(len(top), len(bottom))  # rounds both methods ran (the same count in a complete run)
        picks = rng.integers(0, n, size=(resamples, n))
        ratios[:, k] = np.median(top[:n][picks], axis=1) / np.median(bottom[:n][picks], axis=1)
    point = float(np.median([by[(sc, b, num)]["median_s"] / by[(sc, b, den)]["median_s"] for sc, b in cells]))
    return list(percentile_interval(np.median(ratios, axis=1), point, level=level))
