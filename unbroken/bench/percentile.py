"""The percentile interval of a bootstrap, shared by the benchmarks that report one.

`percentile_interval(samples, point)`: the central `level` quantiles of the resampled statistic,
widened to include the point estimate (a handful of rounds can leave the point just outside
the resampled quantiles; an interval that excludes its own estimate would mislead).
"""
from __future__ import annotations

import numpy as np


def percentile_interval(samples, point: float, *, level: float = 0.95) -> tuple[float, float]:
    """(lo, hi): the (1-level)/2 and (1+level)/2 quantiles of `samples`, widened to hold `point`."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    lo, hi = np.quantile(np.asarray(samples, dtype=float), [(1 - level) / 2, (1 + level) / 2])
    return min(float(lo), point), max(float(hi), point)
