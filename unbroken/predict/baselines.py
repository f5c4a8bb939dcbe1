"""The baselines the regressors must beat: load-scaled TDP for power, calibrated roofline for ITL.

Both learn one number per scenario from the training split and nothing else, so they are
cheap and have no notion of which GPU or model they face beyond its specs:
  power = TDP × mean(power/TDP over training rows of the same scenario)   (WattGPU's baseline)
  ITL   = c × max(2·params/bandwidth, 2·params·batch/TFLOPS) / n_gpus,
          c = median(measured/roofline) over the training rows           (a roofline that knows
          real kernels reach a fraction of peak)
"""
from __future__ import annotations

import numpy as np

from unbroken.predict.dataset import Table
from unbroken.predict.features import FEATURES

_SCENARIO = FEATURES.index("scenario")


def _per_scenario(train: Table, test: Table, values: np.ndarray, reduce) -> np.ndarray:
    """reduce(values) per scenario of the training rows, looked up for each test row (global fallback)."""
    s_train, s_test = train.X[:, _SCENARIO], test.X[:, _SCENARIO]
    ok = np.isfinite(values)
    fallback = reduce(values[ok])
    table = {s: reduce(values[ok & (s_train == s)]) for s in set(s_train[ok].tolist())}
    return np.array([table.get(s, fallback) for s in s_test.tolist()])


def tdp_power(train: Table, test: Table) -> np.ndarray:
    """Predicted power per GPU (W) for the test rows."""
    frac = _per_scenario(train, test, train.power_w / train.tdp_w, np.mean)
    return test.tdp_w * frac


def roofline_itl(train: Table, test: Table) -> np.ndarray:
    """Predicted ITL (s) for the test rows; rows with no roofline get the training median ITL."""
    c = _per_scenario(train, test, train.itl_s / train.roofline_s, np.median)
    pred = c * test.roofline_s
    return np.where(np.isfinite(pred), pred, np.nanmedian(train.itl_s))
