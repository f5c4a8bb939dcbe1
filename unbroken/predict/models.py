"""The regressors: XGBoost (power/TDP, log ITL) with a small search, and a conformal interval.

Two target forms for ITL: `direct` fits log ITL; `roofline_ratio` fits log(ITL / roofline),
the per-token roofline being a feature column, so the trees learn only an efficiency factor
and the roofline carries the prediction beyond the training GPUs' specs. Which form and
which hyperparameters: chosen by inner folds of the training split only (`fit`).

The interval is split-conformal on out-of-fold predictions: the inner folds that choose the
hyperparameters also give each training row a prediction from a model that did not see it;
the (1-alpha) quantile of |log(pred/true)| over those rows is the half-width, in log space,
of every interval [pred·e^-q, pred·e^q]. With group folds (by GPU under LOGO, by model under
LOLO) the residuals carry the shift to an unseen group, so the width is honest about it.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace

import numpy as np

from unbroken.predict import siblings
from unbroken.predict.features import FEATURES, ROOFLINE, TREE_COLUMNS
from unbroken.predict.siblings import Hardware, Law, Part

TARGETS = ("power", "itl")
FLOOR = 1e-4  # a tree ensemble may predict <= 0 for power/TDP; logs need a floor
FORMS = ("direct", "roofline_ratio")
# how a GPU with training rows is predicted: by the trees, which saw its rows; by the transfer from
# its nearest other part of the same maker, ignoring them; or by that transfer times its own level
# per framework over those rows (`siblings.own_levels`): with 1-5 rows of a new GPU the trees have
# little to go on, while a level is one number per framework
SEEN_MODES = ("trees", "sibling", "sibling_level")


@dataclass(frozen=True)
class XgbConfig:
    """XGBoost hyperparameters (defaults: gradient-boosted trees as WattGPU trains them, hist method),
    and the two choices the search makes with them: the ITL target form and the sibling transfer."""

    n_estimators: int = 200
    max_depth: int = 6
    learning_rate: float = 0.1
    subsample: float = 0.8
    colsample_bytree: float = 0.8
    min_child_weight: float = 1.0
    n_jobs: int = 1  # more threads spin-wait on a shared, loaded box (measured: 15x slower)
    seed: int = 0
    target_form: str = "direct"  # or "roofline_ratio" (ITL only): see the module docstring
    # ITL of a GPU with no training rows by transfer from its sibling by this law (`siblings.Law`);
    # None: the trees alone
    sibling_law: Law | None = None
    # ((serving framework code, its law or None), ...): frameworks whose law is not sibling_law
    framework_laws: tuple[tuple[float, Law | None], ...] = ()
    seen_mode: str = "trees"  # SEEN_MODES; all but "trees" need a law

    def __post_init__(self) -> None:
        # a JSON round trip (the service's cache) gives lists and dicts: keep the config hashable and equal
        object.__setattr__(self, "sibling_law", Law.of(self.sibling_law))
        object.__setattr__(self, "framework_laws", tuple(sorted(
            ((float(f), Law.of(a)) for f, a in self.framework_laws), key=lambda fa: fa[0])))
        if self.seen_mode not in SEEN_MODES or (self.seen_mode != "trees" and not self.transfers):
            raise ValueError(f"seen_mode must be one of {', '.join(SEEN_MODES)} (all but 'trees' with a "
                             f"sibling_law), got {self.seen_mode!r}")
        if self.target_form not in FORMS:
            raise ValueError(f"target_form must be one of {', '.join(FORMS)}, got {self.target_form!r}")
        if self.n_estimators < 1 or self.max_depth < 1:
            raise ValueError(f"n_estimators and max_depth must be >= 1, got {self.n_estimators}, {self.max_depth}")
        if not (0 < self.learning_rate <= 1 and 0 < self.subsample <= 1 and 0 < self.colsample_bytree <= 1):
            raise ValueError("learning_rate, subsample and colsample_bytree must be in (0, 1]")

    def law_for(self, framework: float) -> Law | None:
        """The sibling-transfer law of a serving framework's rows (None: the trees)."""
        return dict(self.framework_laws).get(float(framework), self.sibling_law)

    @property
    def transfers(self) -> bool:
        """Whether any framework's ITL may come from a sibling."""
        return self.sibling_law is not None or any(a is not None for _, a in self.framework_laws)


DEFAULT = XgbConfig()
# three tree shapes x the target forms: the search is nested in every outer split (LOGO, LOLO
# included), so each candidate costs a fit per inner fold per outer fold on a 2-core box
_SHAPES = (DEFAULT, replace(DEFAULT, max_depth=3), replace(DEFAULT, max_depth=8, min_child_weight=3.0))
SEARCH_GRID = tuple(replace(c, target_form=f) for f in FORMS for c in _SHAPES)


def _log_base(X: np.ndarray, form: str) -> np.ndarray:
    """log of what the ITL target is divided by: 1, or the row's roofline (0 where it is unknown,
    so such a row falls back to the direct form)."""
    if form == "direct":
        return np.zeros(len(X))
    base = X[:, ROOFLINE]
    return np.where(np.isfinite(base), base, 0.0)


def to_target(target: str, y: np.ndarray, X: np.ndarray, form: str = "direct") -> np.ndarray:
    """What the trees fit: power/TDP as is; log ITL, less log roofline in the ratio form."""
    return np.log(y) - _log_base(X, form) if target == "itl" else y


def from_target(target: str, z: np.ndarray, X: np.ndarray, form: str = "direct") -> np.ndarray:
    return np.exp(z + _log_base(X, form)) if target == "itl" else np.maximum(z, FLOOR)


def forms_for(target: str) -> tuple[str, ...]:
    """Target forms that make sense for `target` (power is already a ratio: power/TDP)."""
    return FORMS if target == "itl" else ("direct",)


def balanced_weights(labels: np.ndarray) -> np.ndarray:
    """Row weights that give every label (GPU) the same total weight, mean 1. Unweighted, a GPU
    measured 1,105 times (the MI300X) outweighs one measured 41 times (the SN40L) 27-fold, and the
    trees learn the efficiency of the most-measured software stacks; balanced, each training GPU
    counts as one example of an accelerator, which is what an unseen one is (docs/predict.md).
    XGBoost's min_child_weight counts these weights: a leaf may then hold fewer rows of a
    sparsely measured GPU, and needs more of a heavily measured one."""
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    w = 1.0 / counts[inverse.ravel()]
    return w / w.mean()


class Trees:
    """An XGBoost regressor over the feature columns the trees see (`features.TREE_COLUMNS`): it
    takes whole feature rows, as every caller holds them."""

    def __init__(self, booster) -> None:
        self.booster = booster

    def predict(self, X: np.ndarray) -> np.ndarray:
        return self.booster.predict(X[:, TREE_COLUMNS])

    def save_model(self, path) -> None:
        self.booster.save_model(path)


def fit_xgb(X: np.ndarray, z: np.ndarray, cfg: XgbConfig, weights: np.ndarray | None = None) -> Trees:
    import xgboost as xgb

    model = xgb.XGBRegressor(n_estimators=cfg.n_estimators, max_depth=cfg.max_depth,
                             learning_rate=cfg.learning_rate, subsample=cfg.subsample,
                             colsample_bytree=cfg.colsample_bytree, min_child_weight=cfg.min_child_weight,
                             n_jobs=cfg.n_jobs, random_state=cfg.seed, tree_method="hist", verbosity=0)
    model.fit(X[:, TREE_COLUMNS], z, sample_weight=weights)
    return Trees(model)


class _Memo:
    """A fitted model whose predictions are kept by input rows. Within one fold the search asks for
    the same rows once per law and seen mode: the trees' own, each sibling's, each level's."""

    def __init__(self, model) -> None:
        self.model, self._seen = model, {}

    def predict(self, X: np.ndarray) -> np.ndarray:
        key = (X.shape, hashlib.blake2b(np.ascontiguousarray(X).tobytes(), digest_size=16).digest())
        if key not in self._seen:
            self._seen[key] = self.model.predict(X)
        return self._seen[key]


def inner_folds(n: int, groups: np.ndarray | None, k: int, seed: int = 0,
                shots: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Group folds when there are >= 2 groups, else shuffled row folds (the interval then only
    knows in-distribution error, which docs/predict.md says where it matters). `shots` > 0 (group
    folds only): that many random rows of each held-out group, at most all but one, go to the fold's
    training side, as the outer few-shot split does (`evaluate.splits`), so that the search and the
    interval are scored on the task they will face."""
    from sklearn.model_selection import GroupKFold, KFold

    idx = np.arange(n)
    if groups is None or len(set(groups.tolist())) < 2:
        return list(KFold(n_splits=min(k, n), shuffle=True, random_state=seed).split(idx))
    k = min(k, len(set(groups.tolist())))
    folds = list(GroupKFold(n_splits=k).split(idx, groups=groups))
    if not shots:
        return folds
    rng = np.random.default_rng(seed)
    return [keep_shots(tr, te, groups, shots, rng) for tr, te in folds]


def keep_shots(train: np.ndarray, test: np.ndarray, groups: np.ndarray, shots: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) with `shots` random test rows of each group in `test` (at most all but one)
    moved to the training side: the few measurements of a held-out GPU or model, both for the outer
    few-shot split (`evaluate.splits`) and for the inner folds (`inner_folds`)."""
    moved = [rng.choice(rows, size=min(shots, len(rows) - 1), replace=False)
             for rows in (test[groups[test] == g] for g in sorted(set(groups[test].tolist())))]
    moved = np.concatenate(moved) if moved else test[:0]
    return np.sort(np.r_[train, moved]), np.setdiff1d(test, moved)


def conformal_halfwidth(pred: np.ndarray, true: np.ndarray, coverage: float) -> float:
    """Split-conformal quantile of |log(pred/true)|: ceil((n+1)·coverage)-th smallest residual."""
    r = np.abs(np.log(np.maximum(pred, FLOOR) / true))
    r = np.sort(r[np.isfinite(r)])  # rows a fold did not predict (a few-shot fold's shots) are no residual
    if len(r) == 0:
        return math.inf
    rank = math.ceil((len(r) + 1) * coverage)
    return float(r[min(rank, len(r)) - 1]) if rank <= len(r) else float(r[-1]) * 1.5


@dataclass
class Predictor:
    """A fitted regressor for one target, its chosen config and its interval half-widths (log
    space): one per category of the calibration rows (Mondrian conformal: a server-scenario
    query gets the width measured on server rows), `halfwidth` for categories never seen."""

    target: str
    model: object
    config: XgbConfig
    halfwidth: float
    coverage: float
    by_category: dict = field(default_factory=dict)
    # True when the calibration folds were grouped (>= 2 groups); False: row folds, so the width
    # knows only in-distribution error and says nothing about an unseen GPU or model
    grouped: bool = False
    # widths and seen mode for a GPU measured in training (`measured_widths`): {"levels": {shots:
    # {"halfwidth", "by_category", "seen_mode"}}, "rows": {gpu: training rows}}; None: not calibrated
    measured: dict | None = None
    # the GPUs of the training rows, for sibling transfer (config.sibling_law not None), and each
    # one's own level per framework against its nearest other part (seen_mode "sibling_level"),
    # keyed (GPU, framework code)
    parts: tuple[Part, ...] = ()
    gpu_levels: dict = field(default_factory=dict)

    def rows_of(self, gpu: str) -> int:
        """How many training rows `gpu` had (0: never measured, or no measured widths)."""
        return int(self.measured["rows"].get(gpu, 0)) if self.measured else 0

    def _level(self, rows: int) -> int | None:
        """The largest few-shot level (SHOT_LEVELS) that `rows` training rows reach (None: unseen)."""
        return max((n for n in (self.measured or {}).get("levels", {}) if n <= rows), default=None)

    def seen_mode(self, rows: int = 0) -> str:
        """How a GPU with `rows` training rows is predicted: the mode its few-shot level measured
        better (`measured_widths`), else the config's (the search's choice under few-shot folds)."""
        level = self._level(rows)
        return self.config.seen_mode if level is None else self.measured["levels"][level].get("seen_mode", "trees")

    def widths(self, categories: np.ndarray | None, rows: int = 0) -> np.ndarray | float:
        """Half-widths for a GPU with `rows` training rows: those of the largest few-shot level it
        reaches (SHOT_LEVELS), else an unseen GPU's."""
        level = self._level(rows)
        src = self.measured["levels"][level] if level is not None else \
            {"halfwidth": self.halfwidth, "by_category": self.by_category}
        pooled, by = src["halfwidth"], src["by_category"]
        if categories is None or not by:
            return pooled
        return np.array([by.get(float(c), pooled) for c in categories])

    def predict(self, X: np.ndarray, categories: np.ndarray | None = None, rows: int = 0,
                makers: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(point, low, high) in target units: power/TDP or ITL seconds. `rows`: training rows of
        the GPU asked about (its interval is the few-shot one of that many rows; 0: unseen).
        `makers`: each row's GPU manufacturer, for sibling transfer (none without)."""
        return self.predict_via(X, categories, rows, makers)[:3]

    def predict_via(self, X: np.ndarray, categories: np.ndarray | None = None, rows: int = 0,
                    makers: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str | None]]:
        """`predict`'s (point, low, high), and the measured GPU each row's prediction was
        transferred from (None: the trees alone)."""
        p, via = point(self.model, X, self.target, self.config, makers, self.parts, self.gpu_levels,
                       self.seen_mode(rows))
        q = self.widths(categories, rows)
        return p, p * np.exp(-q), p * np.exp(q), via


def point(model, X: np.ndarray, target: str, cfg: XgbConfig, makers: np.ndarray | None, known: tuple[Part, ...],
          levels: dict | None = None, seen_mode: str | None = None) -> tuple[np.ndarray, list[str | None]]:
    """`model`'s prediction in target units and each row's sibling (None: the trees' own). Where
    cfg gives the row's framework a law (`XgbConfig.law_for`): a GPU with no training rows by
    transfer where one applies; a measured GPU, in seen_mode (else cfg's) "sibling", by transfer
    from its nearest other part, in "sibling_level" that times its level for the row's framework in
    `levels` (where it has one), in "trees" by the trees."""
    seen_mode = cfg.seen_mode if seen_mode is None else seen_mode
    p = from_target(target, model.predict(X), X, cfg.target_form)
    if not cfg.transfers or makers is None or not known or target != "itl":
        return p, [None] * len(X)

    def predict_s(Xs: np.ndarray) -> np.ndarray:
        return from_target(target, model.predict(Xs), Xs, cfg.target_form)

    t = siblings.transfer(predict_s, X, makers, known, cfg.law_for, measured_ok=seen_mode != "trees")
    itl = t.itl_s
    if seen_mode == "sibling_level" and levels:  # a framework the GPU has no level for: its sibling's
        fw = X[:, FEATURES.index("framework")]
        itl = itl * np.array([1.0 if g is None else levels.get((g, float(f)), 1.0) for g, f in zip(t.own, fw)])
    return np.where(np.isfinite(itl), itl, p), t.via


MIN_CATEGORY_ROWS = 30  # fewer calibration rows than this: the category uses the pooled width
# a GPU with n training rows gets the interval and seen mode of LOGO with the largest level <= n: at
# 1-20 rows a level read off its rows may beat the trees, with its rows by the hundred the trees
# know it (the H100's 1,065 rows at the 20-row level took its sibling's ITL times its level:
# 25.5 ms for an ML.ENERGY row the trees fit at 40.8 and that measured 35.1)
SHOT_LEVELS = (1, 5, 20, 100)


def mondrian_halfwidths(pred: np.ndarray, true: np.ndarray, categories: np.ndarray | None,
                        coverage: float) -> dict:
    if categories is None:
        return {}
    out = {}
    for c in set(categories.tolist()):
        sel = categories == c
        if sel.sum() >= MIN_CATEGORY_ROWS:
            out[float(c)] = conformal_halfwidth(pred[sel], true[sel], coverage)
    return out


def oof_predictions(X: np.ndarray, y: np.ndarray, target: str, folds, cfg: XgbConfig,
                    balance: np.ndarray | None = None, hardware: Hardware | None = None,
                    laws: tuple[Law | None, ...] | None = None,
                    modes: tuple[str, ...] | None = None) -> dict[tuple, np.ndarray]:
    """Out-of-fold predictions of `cfg`, target units, keyed (law, seen mode): each sibling-transfer
    law in `laws` for every framework (default: cfg's own laws, keyed by its sibling_law;
    None: the trees alone) with each of `modes` (default: cfg's; they differ only for a held-out
    GPU with rows in training, a few-shot fold's); one fit per fold serves them all. `hardware`:
    the rows' GPUs and makers (no transfer without)."""
    modes = modes or (cfg.seen_mode,)
    if laws is None:  # cfg as it is (its per-framework laws included)
        variants = {(cfg.sibling_law, m): replace(cfg, seen_mode=m) for m in modes if cfg.transfers or m == "trees"}
    else:  # one law for every framework; without one (the trees) the seen modes are all the trees
        variants = {(a, m): replace(cfg, sibling_law=a, framework_laws=(), seen_mode=m)
                    for a in laws for m in modes if a is not None or m == "trees"}
    out = {key: np.full(len(y), np.nan) for key in variants}
    for tr, te in folds:
        w = None if balance is None else balanced_weights(balance[tr])
        model = _Memo(fit_xgb(X[tr], to_target(target, y[tr], X[tr], cfg.target_form), cfg, w))
        hw = hardware.take(tr) if hardware is not None else None
        known = siblings.parts(X[tr], hw, y[tr]) if hw is not None and target == "itl" else ()  # power never transfers
        makers = None if hardware is None else hardware.maker[te]
        held = set() if hardware is None else set(hardware.gpu[te].tolist())
        for key, c in variants.items():
            levels = own_levels(model, X[tr], y[tr], target, c, hw, known, held) \
                if c.seen_mode == "sibling_level" and known else None
            out[key][te] = point(model, X[te], target, c, makers, known, levels)[0]
    return out


def own_levels(model, X: np.ndarray, y: np.ndarray, target: str, cfg: XgbConfig, hw: Hardware,
               known: tuple[Part, ...], only: set[str] | None = None) -> dict[tuple[str, float], float]:
    """`siblings.own_levels` with `model`'s ITL and cfg's laws."""
    return siblings.own_levels(lambda Xs: from_target(target, model.predict(Xs), Xs, cfg.target_form),
                               X, y, hw, known, cfg.law_for, only)


def per_framework(oofs: dict[tuple, np.ndarray], y: np.ndarray, framework: np.ndarray, cfg: XgbConfig,
                  mode: str, gpus: np.ndarray | None = None) -> tuple[np.ndarray, XgbConfig] | None:
    """The out-of-fold predictions and config of the best law for each serving framework apart, from
    `oofs` (`oof_predictions` keyed (law, mode), with (None, "trees")), in seen mode `mode`; None when
    that is one law for all (the plain candidate is that) or no transfer at all. The remaining
    sibling_law is the one chosen for most rows. Best: the least MdAPE over that framework's rows
    that some law moves, with `gpus` (each row's GPU) the mean of each GPU's MdAPE over them, so a
    part measured 1,105 times does not outvote three measured 300 times (the reason for
    `balanced_weights`; the A100's TensorRT-LLM rows, 21% too slow at seed 0, came out level;
    docs/predict.md); ties: the law offered first.

    A framework whose rows no law moves (no sibling ran it) is left out: the trees predict it
    whatever its law, and should a sibling run it at the refit it takes the remaining law. A
    framework with a sibling gets a law, never the trees: that choice would be scored on the
    inner folds' held-out parts, mostly NVIDIA, whose spec neighbours are close, and applied to a
    part whose vendor's level is far from its spec neighbours (seed 0: the MI250's llama.cpp rows
    611% off by the trees, about 25% by its sibling's transfer; docs/predict.md). The plain
    no-transfer candidate still competes."""
    def oof(a: Law | None) -> np.ndarray:
        return oofs[(a, "trees" if a is None else mode)]

    laws = [a for a, m in oofs if a is not None and m == mode]
    combined, choice, rows = oof(None).copy(), {}, {}  # a row without a framework has no sibling
    for f in sorted(set(framework[np.isfinite(framework)].tolist())):
        sel = framework == f
        # the rows some law moves (a sibling ran their setup) are the only ones a choice of law changes:
        # it is made on them (the trees' error on the others would only shift which row is the median)
        moved = {a: sel & _differs(oof(a), oof(None)) for a in laws}
        moves = np.logical_or.reduce(list(moved.values()))
        if not moves.any():  # no sibling: any law predicts these rows as the trees do
            continue
        choice[f] = min((a for a in laws if moved[a].any()),
                        key=lambda a: (_balanced_mdape(oof(a), y, moves, gpus), laws.index(a)))
        combined[sel] = oof(choice[f])[sel]
        rows[choice[f]] = rows.get(choice[f], 0) + int(sel.sum())
    if len(rows) < 2:
        return None
    rest = max(rows, key=rows.get)  # also a framework no sibling ran here, should one at the refit
    return combined, replace(cfg, sibling_law=rest, seen_mode=mode,
                             framework_laws=tuple((f, a) for f, a in choice.items() if a != rest))


def _balanced_mdape(pred: np.ndarray, y: np.ndarray, rows: np.ndarray, gpus: np.ndarray | None) -> float:
    """MdAPE over `rows`, or with `gpus` the mean of each GPU's MdAPE over its `rows`."""
    if gpus is None:
        return mdape(pred[rows], y[rows])
    return float(np.mean([mdape(pred[rows & (gpus == g)], y[rows & (gpus == g)]) for g in set(gpus[rows].tolist())]))


def _differs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: whether two predictions differ (two NaNs do not)."""
    return (a != b) & ~(np.isnan(a) & np.isnan(b))


def mdape(pred: np.ndarray, true: np.ndarray) -> float:
    """Median absolute percentage error, in percent, over rows where both are finite."""
    ok = np.isfinite(pred) & np.isfinite(true) & (true != 0)
    return float(np.median(np.abs(pred[ok] - true[ok]) / np.abs(true[ok])) * 100) if ok.any() else math.nan


def fit(X: np.ndarray, y: np.ndarray, target: str, *, groups: np.ndarray | None = None,
        grid: tuple[XgbConfig, ...] = (DEFAULT,), coverage: float = 0.9, k: int = 5,
        categories: np.ndarray | None = None, balance: np.ndarray | None = None, shots: int = 0,
        hardware: Hardware | None = None, framework_laws: bool = True) -> Predictor:
    """Choose a config from `grid` by inner-fold MdAPE, calibrate the interval on the same
    out-of-fold predictions, refit the chosen config on all rows. A config whose target form does
    not apply to `target` is tried in the direct form (duplicates once). `balance`: labels (the
    GPU of each row) whose groups get equal weight in every fit (`balanced_weights`); the scores
    and the interval stay unweighted, as the held-out metric is. `shots`: few-shot inner folds
    (`inner_folds`). `hardware` (ITL): each config is also scored with sibling transfer at every
    law in siblings.LAWS its GPUs support (`siblings.laws_for`) and, with `framework_laws`, with
    each framework's best law apart (`per_framework`); the simpler candidate wins ties (under CV
    and LOLO no row has a sibling: the trees alone)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    grid = tuple(dict.fromkeys(c if c.target_form in forms_for(target) else replace(c, target_form="direct")
                               for c in grid))
    if len(y) < 2:
        raise ValueError(f"cannot train the {target} model on {len(y)} row(s): the training split is empty")
    folds = inner_folds(len(y), groups, k, shots=shots)
    transfer = target == "itl" and hardware is not None
    laws = (None,) + (siblings.laws_for(hardware) if transfer else ())
    modes = SEEN_MODES if shots else ("trees",)  # without shots no held-out GPU is in training
    best = None
    for cfg in grid:
        oofs = oof_predictions(X, y, target, folds, cfg, balance, hardware, laws, modes)
        candidates = [(v, replace(cfg, sibling_law=a, seen_mode=m)) for (a, m), v in oofs.items()]
        if transfer and framework_laws:
            found = (per_framework(oofs, y, X[:, FEATURES.index("framework")], cfg, m, hardware.gpu) for m in modes)
            candidates += [c for c in found if c is not None]
        for oof, c in candidates:
            score = mdape(oof, y)
            if best is None or score < best[0]:
                best = (score, c, oof)
    _, cfg, oof = best
    model = fit_xgb(X, to_target(target, y, X, cfg.target_form), cfg,
                    None if balance is None else balanced_weights(balance))
    grouped = groups is not None and len(set(groups.tolist())) >= 2
    known = siblings.parts(X, hardware, y) if transfer else ()  # power never transfers
    levels = own_levels(model, X, y, target, cfg, hardware, known) \
        if known and cfg.seen_mode == "sibling_level" else {}  # measured_widths adds them where it needs them
    return Predictor(target=target, model=model, config=cfg, halfwidth=conformal_halfwidth(oof, y, coverage),
                     coverage=coverage, by_category=mondrian_halfwidths(oof, y, categories, coverage), grouped=grouped,
                     parts=known, gpu_levels=levels)


def measured_widths(p: Predictor, X: np.ndarray, y: np.ndarray, groups: np.ndarray, k: int,
                    categories: np.ndarray | None = None, balance: np.ndarray | None = None,
                    hardware: Hardware | None = None) -> Predictor:
    """`p` with intervals for a GPU the training data has rows of: for each n in SHOT_LEVELS, the
    conformal widths of `p`'s config on group folds that keep n rows of each held-out group, and the
    seen mode that predicted those folds better (ties: the trees); figures in docs/predict.md."""
    levels, gpu_levels, transfers = {}, p.gpu_levels, p.config.transfers and hardware is not None
    if transfers and p.parts and not gpu_levels:
        gpu_levels = own_levels(p.model, X, y, p.target, p.config, hardware, p.parts)
    modes = SEEN_MODES if transfers and gpu_levels else ("trees",)
    for n in SHOT_LEVELS:
        folds = inner_folds(len(y), groups, k, shots=n)
        oofs = oof_predictions(X, y, p.target, folds, p.config, balance, hardware, modes=modes)
        mode, oof = min(((m, v) for (_, m), v in oofs.items()), key=lambda mv: mdape(mv[1], y))  # ties: trees
        levels[n] = {"halfwidth": conformal_halfwidth(oof, y, p.coverage),
                     "by_category": mondrian_halfwidths(oof, y, categories, p.coverage), "seen_mode": mode}
    names, counts = np.unique(groups, return_counts=True)
    return replace(p, measured={"levels": levels, "rows": {str(g): int(n) for g, n in zip(names, counts)}},
                   gpu_levels=gpu_levels)
