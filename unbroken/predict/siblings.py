"""Sibling transfer: the ITL of a GPU the training data never measured, read off its nearest measured
part of the same manufacturer and scaled by their rooflines.

Leaving one accelerator out of LLM-Inference-Bench showed that an unseen part's level is set by
its vendor's software stack, not by its datasheet (docs/predict.md): trees that place the MI250
between its spec neighbours, an A100 and a Max 1550, miss it 4-fold, although the MI300X, on the
same ROCm stack, runs the same workloads at a steady ratio to it. So for a GPU with no training
rows, the prediction is the trees' ITL *for its sibling* (the measured part of the same
manufacturer nearest in log bandwidth and log TFLOPS that ran the row's serving framework), times
(roofline on the GPU ÷ roofline on the sibling) ** alpha: alpha = 1 trusts the datasheet ratio
fully, 0 copies the sibling; the nested search picks alpha on leave-one-GPU-out folds, or no
transfer at all. A GPU whose figures equal a measured part's is that part (the trees know it);
one whose manufacturer has no measured part, or whose framework no sibling ran, keeps the trees'
own prediction.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from unbroken.predict.features import FEATURES, GPU_COLUMNS, ROOFLINE, with_gpu

ALPHAS = (0.5, 0.75, 1.0)  # offered to the nested search next to "no transfer"
_FRAMEWORK = FEATURES.index("framework")
_DISTANCE = [GPU_COLUMNS.index(FEATURES.index(c)) for c in ("memory_bandwidth_gb_s", "tensor_tflops")]


class Hardware(NamedTuple):
    """Each row's GPU label and that GPU's manufacturer (`Table.gpu`, `Table.maker`)."""

    gpu: np.ndarray
    maker: np.ndarray

    def take(self, idx: np.ndarray) -> "Hardware":
        return Hardware(self.gpu[idx], self.maker[idx])


@dataclass(frozen=True)
class Part:
    """A GPU with training rows: its name, manufacturer, GPU_COLUMNS figures, frameworks it ran."""

    name: str
    maker: str
    figures: tuple[float, ...]
    frameworks: frozenset[float]

    def distance(self, figures: np.ndarray) -> float:
        a, b = np.log(np.asarray(self.figures)[_DISTANCE]), np.log(figures[_DISTANCE])
        return float(np.sum((a - b) ** 2))

    def same_gpu(self, figures: np.ndarray) -> bool:
        mine = np.asarray(self.figures)
        return bool(np.all((mine == figures) | (np.isnan(mine) & np.isnan(figures))))


def parts(X: np.ndarray, hw: Hardware) -> tuple[Part, ...]:
    """The measured parts in training rows `X` (one per GPU label)."""
    out = []
    for g in sorted(set(hw.gpu.tolist())):
        rows = np.flatnonzero(hw.gpu == g)
        out.append(Part(name=str(g), maker=str(hw.maker[rows[0]]), figures=tuple(X[rows[0]][list(GPU_COLUMNS)].tolist()),
                        frameworks=frozenset(X[rows, _FRAMEWORK][np.isfinite(X[rows, _FRAMEWORK])].tolist())))
    return tuple(out)


def _transferable(figures: np.ndarray) -> bool:
    return bool(np.all(np.isfinite(figures[_DISTANCE])) and np.all(figures[_DISTANCE] > 0))


def sibling(known: tuple[Part, ...], maker: str, figures: np.ndarray, framework: float) -> Part | None:
    """The part a row of a GPU (`maker`, `figures`) takes its ITL from, or None: the GPU was measured
    itself, has no maker or figures to compare, or no part of its maker ran `framework`."""
    if not maker or not _transferable(figures) or any(p.maker == maker and p.same_gpu(figures) for p in known):
        return None
    same = [p for p in known if p.maker == maker and framework in p.frameworks
            and _transferable(np.asarray(p.figures))]
    return min(same, key=lambda p: p.distance(figures)) if same else None


def transfer(predict_s: Callable[[np.ndarray], np.ndarray], X: np.ndarray, makers: np.ndarray,
             known: tuple[Part, ...], alpha: float) -> tuple[np.ndarray, list[str | None]]:
    """(ITL in seconds by sibling transfer, NaN where none applies; the sibling of each row).
    `predict_s`: the trees' ITL for feature rows, in seconds."""
    out = np.full(len(X), np.nan)
    used: list[str | None] = [None] * len(X)
    by_part: dict[Part, list[int]] = {}
    for i in range(len(X)):
        p = sibling(known, str(makers[i]), X[i][list(GPU_COLUMNS)], X[i, _FRAMEWORK])
        if p is not None:
            by_part.setdefault(p, []).append(i)
            used[i] = p.name
    for p, rows in by_part.items():
        Xs = with_gpu(X[rows], np.asarray(p.figures))
        out[rows] = predict_s(Xs) * np.exp(alpha * (X[rows, ROOFLINE] - Xs[:, ROOFLINE]))
    return out, used
