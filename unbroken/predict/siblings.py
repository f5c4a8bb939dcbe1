"""Sibling transfer: the ITL of a GPU the training data never measured, read off its nearest measured
part of the same manufacturer and scaled by their rooflines.

Leaving one accelerator out of LLM-Inference-Bench showed that an unseen part's level is set by
its vendor's software stack, not by its datasheet (docs/predict.md): trees that place the MI250
among its spec neighbours, an A100 and a Max 1550, miss it 5-fold, although on the configurations
both ran, its ITL is 1.3x the MI300X's under vLLM and 2.0x under llama.cpp (within 19% and 10%
of those ratios, median): the same ROCm stack, one level apart. So for a GPU with no training
rows, the prediction is the trees' ITL *for its sibling* (the measured part of the same
manufacturer nearest in log bandwidth and log TFLOPS that ran the row's serving framework in the
row's scenario: a sibling's offline vLLM rows say little of a server's, which ML.ENERGY measured
several-fold slower against the roofline), carried over by a transfer law (`Law`): the sibling's ITL
times (roofline on the GPU ÷ roofline on the sibling) ** alpha (alpha = 1 trusts the datasheet ratio
fully, 0 copies the sibling); or the sibling's ITL plus c × (roofline on the GPU − roofline on the
sibling) × the sibling stack's efficiency (what the sibling spends beyond that, the host's share,
carries over unchanged); or the sibling's ITL divided by the bandwidth and the TFLOPS ratios, each to
its own exponent. Where the row's batch is beyond any the sibling ran, the sibling's ITL follows its
own line in the batch (`beyond_batches`): trees do not extrapolate.
The nested search picks the law on leave-one-GPU-out folds, or no transfer at all, for all serving
frameworks or for each apart (a stack's efficiency need not follow the datasheet as another's does;
models.XgbConfig.framework_laws). A GPU whose figures equal a measured part's is that part (the trees know it);
one whose manufacturer has no measured part, or whose setup (framework, scenario) no sibling ran,
keeps the trees' own prediction. A GPU with a few rows may be predicted by its sibling too (models.SEEN_MODES), times
its own level per framework (`own_levels`).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from unbroken.predict.features import FEATURES, GPU_COLUMNS, ROOFLINE, with_batch, with_gpu

_FRAMEWORK = FEATURES.index("framework")
_SCENARIO = FEATURES.index("scenario")
_BATCH = FEATURES.index("log2_batch")
_DISTANCE = [GPU_COLUMNS.index(FEATURES.index(c)) for c in ("memory_bandwidth_gb_s", "tensor_tflops")]
_LAW_RANGE = {"ratio": 2.0, "offset": 8.0, "specs": 2.0}  # each kind's parameter runs from 0 to this


@dataclass(frozen=True)
class Law:
    """How a GPU's ITL follows its sibling's. "ratio": the sibling's ITL times (roofline here ÷
    roofline there) ** value, value = alpha in [0, 2]. "offset": the sibling's ITL plus value × k ×
    (roofline here − roofline there), value = c in [0, 8], k the sibling stack's efficiency in the
    row's setup (`Part.efficiency`: how many rooflines its bandwidth-bound rows take), never below
    the GPU's own roofline. What the sibling spends beyond c·k rooflines (kernel launches,
    scheduling, sampling on the host) carries over unchanged: a host-bound row barely moves, a
    bandwidth-bound one moves with the datasheet. Because k carries the stack's level, one c serves
    a 2x-roofline NVIDIA stack and a 10x AMD one alike (a c in seconds per roofline second does not;
    measured in docs/predict.md). "specs": the sibling's ITL ÷ (bandwidth here ÷ there) ** value ÷
    (TFLOPS here ÷ there) ** compute, both in [0, 2]: the roofline follows whichever of the two bounds
    a row, while a real stack gains from both at once (a newer generation's kernels, clocks and
    caches come with its TFLOPS), and two parts of one chip with different memory (the GH200 and the
    H100) differ in bandwidth alone."""

    kind: str
    value: float
    compute: float = 0.0  # the TFLOPS exponent of a "specs" law; 0 for the other kinds

    def __post_init__(self) -> None:
        top = _LAW_RANGE.get(self.kind)
        if top is None or not 0 <= self.value <= top or not 0 <= self.compute <= _LAW_RANGE["specs"] \
                or (self.compute and self.kind != "specs"):
            raise ValueError(f"a transfer law is ratio (0-2), offset (0-8) or specs (0-2, compute 0-2), "
                             f"got {self.kind!r} {self.value!r} compute {self.compute!r}")
        object.__setattr__(self, "value", float(self.value))
        object.__setattr__(self, "compute", float(self.compute))

    @classmethod
    def of(cls, obj) -> "Law | None":
        """A law from itself, from its JSON form (`dataclasses.asdict`: a dict) or None."""
        if obj is None or isinstance(obj, Law):
            return obj
        if isinstance(obj, dict) and {"kind", "value"} <= set(obj) <= {"kind", "value", "compute"}:
            return cls(str(obj["kind"]), float(obj["value"]), float(obj.get("compute", 0.0)))
        raise ValueError(f"a transfer law is {{'kind': 'ratio', 'offset' or 'specs', 'value': number"
                         f"[, 'compute': number]}}, got {obj!r}")

    def apply(self, itl_there_s: np.ndarray, log_roof_here: np.ndarray, log_roof_there: np.ndarray,
              efficiency: float | np.ndarray = math.nan, log_speedup: tuple[float, float] = (math.nan, math.nan)
              ) -> np.ndarray:
        """The GPU's ITL (s) from its sibling's, given both log rooflines (`features.ROOFLINE`), for
        "offset" the sibling's `efficiency` (per row or one for all), for "specs" the GPU's
        `log_speedup` over the sibling (`log_speedup`: log bandwidth and log TFLOPS ratios); NaN where
        what the law needs is unknown."""
        if self.kind == "ratio":
            return itl_there_s * np.exp(self.value * (log_roof_here - log_roof_there))
        if self.kind == "specs":
            return itl_there_s * np.exp(-self.value * log_speedup[0] - self.compute * log_speedup[1])
        here = np.exp(log_roof_here)
        return np.maximum(itl_there_s + self.value * efficiency * (here - np.exp(log_roof_there)), here)

    @property
    def parameters(self) -> int:
        """How many numbers the law fits: two for "specs", one for the others."""
        return 2 if self.kind == "specs" else 1

    def __str__(self) -> str:
        return f"{self.kind} {self.value:g}" + (f"/{self.compute:g}" if self.kind == "specs" else "")


def log_speedup(figures_here, figures_there) -> tuple[float, float]:
    """log(bandwidth here ÷ there), log(TFLOPS here ÷ there) of two GPUs' GPU_COLUMNS figures (NaN
    where either lacks one): what a "specs" `Law` scales by."""
    here, there = np.asarray(figures_here, dtype=float)[_DISTANCE], np.asarray(figures_there, dtype=float)[_DISTANCE]
    with np.errstate(divide="ignore", invalid="ignore"):
        bw, tf = np.log(here / there)
    return float(bw), float(tf)


# offered to the nested search next to "no transfer"; measured in docs/predict.md
LAWS = tuple(Law("ratio", a) for a in (0.25, 0.5, 0.75, 1.0, 1.25)) + \
    tuple(Law("offset", c) for c in (0.75, 1, 1.5, 2)) + \
    tuple(Law("specs", a, b) for a in (0, 0.25, 0.5, 0.75, 1.0, 1.25) for b in (0, 0.25, 0.5, 0.75))


# a part is a sibling in a setup where it has at least this many training rows: the transfer reads the
# trees' ITL on the sibling, which is a measurement's only where the trees fitted enough of them. With
# one row of the held-out MI300X in its training split (few-shot LOGO), it served as the MI250's
# sibling in the inner folds, the law was chosen on the trees' guess of it, and the split missed the
# MI300X by 48% (21% once it no longer did; docs/predict.md). The fewest rows a part of the shipped
# data ran in a setup: 41 (the SN40L). A GPU with fewer is still known by its own rows (`own_levels`).
SIBLING_MIN_ROWS = 30


def laws_for(hw: "Hardware") -> tuple[Law, ...]:
    """The LAWS a search over training rows of these GPUs (one per row) may choose among: a law only
    where more GPUs than its parameters have a same-maker part to be predicted from on
    leave-one-GPU-out folds, counting the GPUs with SIBLING_MIN_ROWS rows or more (the others are
    nobody's sibling). Two pairs fit a two-exponent law exactly, noise included: ML.ENERGY 2023 under
    LOGO trains on two parts, and the specs law its one pair chose missed the V100 by 21% where one
    exponent missed by 9% (docs/predict.md)."""
    rows = Counter(hw.gpu.tolist())
    makers = Counter(m for g, m in set(zip(hw.gpu.tolist(), hw.maker.tolist())) if m and rows[g] >= SIBLING_MIN_ROWS)
    pairs = sum(n for n in makers.values() if n >= 2)
    return tuple(a for a in LAWS if a.parameters < pairs)


class Hardware(NamedTuple):
    """Each row's GPU label and that GPU's manufacturer (`Table.gpu`, `Table.maker`)."""

    gpu: np.ndarray
    maker: np.ndarray

    def take(self, idx: np.ndarray) -> "Hardware":
        return Hardware(self.gpu[idx], self.maker[idx])


@dataclass(frozen=True)
class Part:
    """A GPU with training rows: its name, manufacturer, GPU_COLUMNS figures, the setups it ran:
    (serving framework code, scenario code) pairs, and per setup its stack's efficiency: the 10th
    percentile of measured ITL ÷ roofline over those rows, (framework, scenario, efficiency) triples
    (the rooflines its bandwidth-bound rows take; `Law`), and per setup the largest batch it ran,
    (framework, scenario, log2 batch) triples (`beyond_batches`)."""

    name: str
    maker: str
    figures: tuple[float, ...]
    setups: frozenset[tuple[float, float]]
    efficiency: tuple[tuple[float, float, float], ...] = ()
    largest_batch: tuple[tuple[float, float, float], ...] = ()

    def efficiency_of(self, setup: tuple[float, float]) -> float:
        return _in_setup(self.efficiency, setup)

    def largest_batch_of(self, setup: tuple[float, float]) -> float:
        """log2 of the largest batch this part ran in `setup` (NaN: none known)."""
        return _in_setup(self.largest_batch, setup)

    def distance(self, figures: np.ndarray) -> float:
        a, b = np.log(np.asarray(self.figures)[_DISTANCE]), np.log(figures[_DISTANCE])
        return float(np.sum((a - b) ** 2))

    def same_gpu(self, figures: np.ndarray) -> bool:
        mine = np.asarray(self.figures)
        return bool(np.all((mine == figures) | (np.isnan(mine) & np.isnan(figures))))


EFFICIENCY_PERCENTILE = 10


def parts(X: np.ndarray, hw: Hardware, itl_s: np.ndarray | None = None) -> tuple[Part, ...]:
    """The measured parts in training rows `X` (one per GPU label), each with the setups it ran at
    least SIBLING_MIN_ROWS times (those it may be a sibling in); with the rows' measured `itl_s`, each
    setup's efficiency too."""
    out = []
    for g in sorted(set(hw.gpu.tolist())):
        rows = np.flatnonzero(hw.gpu == g)
        ran = X[rows][:, [_FRAMEWORK, _SCENARIO]]
        ran, counts = np.unique(ran[np.isfinite(ran).all(axis=1)], axis=0, return_counts=True)
        setups = frozenset(map(tuple, ran[counts >= SIBLING_MIN_ROWS].tolist()))
        Xg, efficiency = X[rows], ()
        if itl_s is not None:
            ratio = itl_s[rows] / np.exp(Xg[:, ROOFLINE])
            efficiency = _per_setup(Xg, setups, np.where(ratio > 0, ratio, np.nan),
                                    lambda r: np.percentile(r, EFFICIENCY_PERCENTILE))
        out.append(Part(name=str(g), maker=str(hw.maker[rows[0]]), figures=tuple(Xg[0][list(GPU_COLUMNS)].tolist()),
                        setups=setups, efficiency=efficiency,
                        largest_batch=_per_setup(Xg, setups, Xg[:, _BATCH], np.max)))
    return tuple(out)


def _per_setup(X: np.ndarray, setups: frozenset, values: np.ndarray,
               reduce: Callable[[np.ndarray], float]) -> tuple[tuple[float, float, float], ...]:
    """(framework, scenario, `reduce` of the finite `values` of that setup's rows X) for each setup with
    such a value: a part's efficiency (10th percentile of ITL ÷ roofline), its largest batch."""
    out = []
    for f, c in sorted(setups):
        ok = (X[:, _FRAMEWORK] == f) & (X[:, _SCENARIO] == c) & np.isfinite(values)
        if ok.any():
            out.append((f, c, float(reduce(values[ok]))))
    return tuple(out)


def _in_setup(triples: tuple[tuple[float, float, float], ...], setup: tuple[float, float]) -> float:
    """The value a `_per_setup` tuple holds for `setup` (NaN: none)."""
    return next((v for f, c, v in triples if (f, c) == tuple(setup)), math.nan)


def beyond_batches(predict_s: Callable[[np.ndarray], np.ndarray], Xs: np.ndarray, largest: float) -> np.ndarray:
    """The trees' ITL (s) for feature rows `Xs` of a part that ran batches up to 2 ** `largest` (NaN:
    unknown, the trees as they are). Beyond that a tree predicts what it learnt at the edge, flat,
    while a real stack's ITL keeps growing (the MI300X's vLLM ITL grows 3.5-fold from batch 64 to
    256, its sibling the MI250 never ran beyond 64, and the trees moved to the MI250 predicted it
    3.3x too fast; docs/predict.md). So a row beyond goes on along the line through the part's two
    largest batches, linear in the batch: a decode step reads the weights once (the intercept) and
    each sequence's cache and compute on top (the slope), so its ITL per doubling grows toward 2x as
    the per-sequence share takes over (measured on the MI300X: 1.4x at 16 -> 32, 1.8-1.9x beyond 64),
    which a constant log-log slope misses (44% on those rows, 32% along the line). The slope is held
    between flat and proportional: a decode step of b sequences takes at most b times one's."""
    itl = np.array(predict_s(Xs), dtype=float)  # a copy: predict_s may hand out a cached array
    far = np.isfinite(largest) & (Xs[:, _BATCH] > largest)
    if far.any():
        top, below = predict_s(with_batch(Xs[far], largest)), predict_s(with_batch(Xs[far], largest - 1.0))
        half = np.clip(top - below, 0.0, top / 2.0)  # what the top half-batch's sequences add, at most their share
        itl[far] = top + half * 2.0 * (np.exp2(Xs[far, _BATCH] - largest) - 1.0)
    return itl


def _transferable(figures: np.ndarray) -> bool:
    return bool(np.all(np.isfinite(figures[_DISTANCE])) and np.all(figures[_DISTANCE] > 0))


def own_part(known: tuple[Part, ...], maker: str, figures: np.ndarray) -> Part | None:
    """The measured part that is this GPU (same maker, same figures), if any."""
    return next((p for p in known if p.maker == maker and p.same_gpu(figures)), None)


def sibling(known: tuple[Part, ...], maker: str, figures: np.ndarray, setup: tuple[float, float],
            measured_ok: bool = False) -> Part | None:
    """The part a row of a GPU (`maker`, `figures`) takes its ITL from, or None: the GPU has no maker
    or figures to compare, no other part of its maker ran `setup` (framework code, scenario code),
    or (unless `measured_ok`: then its nearest *other* part, for a level read off its own rows) the
    GPU was measured itself."""
    own = own_part(known, maker, figures)
    if not maker or not _transferable(figures) or (own is not None and not measured_ok):
        return None
    same = [p for p in known if p.maker == maker and p is not own and tuple(setup) in p.setups
            and _transferable(np.asarray(p.figures))]
    return nearest(same, figures)


def nearest(candidates: list[Part], figures: np.ndarray) -> Part | None:
    """The candidate nearest to a GPU's `figures` in log bandwidth and log TFLOPS (None: no candidate)."""
    return min(candidates, key=lambda p: p.distance(figures)) if candidates else None


def _kinds(X: np.ndarray, makers: np.ndarray) -> dict[tuple, list[int]]:
    """Rows grouped by (maker, GPU figures, framework, scenario): the sibling is one per group."""
    out: dict[tuple, list[int]] = {}
    for i, row in enumerate(np.nan_to_num(X[:, list(GPU_COLUMNS) + [_FRAMEWORK, _SCENARIO]], nan=-1.0)):
        out.setdefault((str(makers[i]), *row.tolist()), []).append(i)
    return out


class Transferred(NamedTuple):
    """`transfer`'s answer, per row: the ITL in seconds (NaN where no transfer applies), the part it
    came from, and the measured part that is the row's GPU itself (None: a GPU with no training rows)."""

    itl_s: np.ndarray
    via: list[str | None]
    own: list[str | None]


def transfer(predict_s: Callable[[np.ndarray], np.ndarray], X: np.ndarray, makers: np.ndarray,
             known: tuple[Part, ...], law_of: Callable[[float], Law | None],
             measured_ok: bool = False) -> Transferred:
    """ITL by sibling transfer. `predict_s`: the trees' ITL for feature rows, in seconds. `law_of`:
    the transfer law for a serving framework's code (None: that framework is not transferred).
    `measured_ok`: see `sibling`."""
    out = Transferred(np.full(len(X), np.nan), [None] * len(X), [None] * len(X))
    for rows in _kinds(X, makers).values():
        first, maker = X[rows[0]], str(makers[rows[0]])
        own = own_part(known, maker, first[list(GPU_COLUMNS)])
        for i in rows:
            out.own[i] = None if own is None else own.name
        law = law_of(float(first[_FRAMEWORK]))
        setup = (float(first[_FRAMEWORK]), float(first[_SCENARIO]))
        p = None if law is None else sibling(known, maker, first[list(GPU_COLUMNS)], setup, measured_ok)
        if p is None:
            continue
        Xs = with_gpu(X[rows], np.asarray(p.figures))
        there = beyond_batches(predict_s, Xs, p.largest_batch_of(setup))
        out.itl_s[rows] = law.apply(there, X[rows, ROOFLINE], Xs[:, ROOFLINE], p.efficiency_of(setup),
                                    log_speedup(first[list(GPU_COLUMNS)], p.figures))
        for i in rows:
            out.via[i] = p.name
    return out


def own_levels(predict_s: Callable[[np.ndarray], np.ndarray], X: np.ndarray, y: np.ndarray, hw: Hardware,
               known: tuple[Part, ...], law_of: Callable[[float], Law | None],
               only: set[str] | None = None) -> dict[tuple[str, float], float]:
    """Per measured GPU (those in `only`, default all) and serving framework it ran: the median of its
    measured ITL ÷ the ITL transferred from its nearest other part, over those rows: the level of its
    own software against its sibling's, which a few measurements of a new GPU fix (seen_mode
    "sibling_level"). Per framework: one stack's level says little of another's on the same part
    (the Max 1550 runs llama.cpp 85x above its roofline, vLLM 16x; docs/predict.md)."""
    out = {}
    for g in sorted(set(hw.gpu.tolist()) if only is None else only & set(hw.gpu.tolist())):
        rows = np.flatnonzero(hw.gpu == g)
        t = transfer(predict_s, X[rows], hw.maker[rows], known, law_of, measured_ok=True).itl_s
        fw = X[rows, _FRAMEWORK]
        for f in sorted(set(fw[np.isfinite(fw)].tolist())):
            ok = np.isfinite(t) & (t > 0) & (fw == f)
            if ok.any():
                out[(str(g), float(f))] = float(np.exp(np.median(np.log(y[rows][ok] / t[ok]))))
    return out
