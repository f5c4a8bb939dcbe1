"""The learned performance model: a scikit-learn random forest trained on twin runs, predicting a
server's throughput, starvation and SLO attainment from (adapter count, ranks, popularity, rate)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor

from unbroken.serve.config import ServeConfig
from unbroken.serve.twin import Costs, simulate
from unbroken.serve.workload import RANKS, AdapterSet, generate

FEATURES = ("adapters", "mean_rank", "max_rank", "top_share", "concentration", "rate", "prompt_mean", "gen_mean")
TARGETS = ("throughput_tok_s", "starved", "slo")  # slo: the fraction finished within the SLO bound


def features(adapters: AdapterSet, rate: float, lengths: tuple[float, float]) -> list[float]:
    """What the forest sees of one server's share of the load: its adapters (count, ranks,
    popularity as the top share and sum of squares), the request rate they receive and the
    workload's mean prompt and output lengths."""
    p = np.array(adapters.popularity)
    r = np.array(adapters.ranks, float)
    return [len(p), float(r.mean()), float(r.max()), float(p.max()), float((p ** 2).sum()), rate, *lengths]


def mean_lengths(arrivals) -> tuple[float, float]:
    return (float(np.mean([a.prompt_len for a in arrivals])), float(np.mean([a.gen_len for a in arrivals])))


def random_case(rng: np.random.Generator, max_adapters: int, max_rate: float) -> tuple[AdapterSet, float]:
    n = int(rng.integers(1, max_adapters + 1))
    w = 1.0 / np.arange(1, n + 1) ** rng.uniform(0.0, 1.6)
    w = rng.permutation(w / w.sum())
    ranks = rng.choice(RANKS, size=n)
    s = AdapterSet(tuple(f"ad{i:03d}" for i in range(n)), tuple(int(x) for x in ranks), tuple(float(x) for x in w))
    return s, float(rng.uniform(0.3, max_rate))


def twin_dataset(cfg: ServeConfig, costs: Costs, *, n: int, seed: int, slo_s: float, duration_s: float,
                 max_adapters: int, max_rate: float) -> tuple[np.ndarray, np.ndarray]:
    """n twin runs on random cases: (features, [throughput, starved, SLO attainment])."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for i in range(n):
        adapters, rate = random_case(rng, max_adapters, max_rate)
        arrivals = generate(adapters, rate=rate, duration_s=duration_s, seed=seed * 100003 + i,
                            bursty=bool(rng.random() < 0.3), prompt_median=float(rng.uniform(2, 24)),
                            gen_median=float(rng.uniform(1, 14)))
        if not arrivals:
            continue
        out, _ = simulate(cfg, adapters, arrivals, costs, slo_s=slo_s)
        xs.append(features(adapters, rate, mean_lengths(arrivals)))
        ys.append([out.throughput_tok_s, out.starved, out.slo])
    return np.array(xs), np.array(ys)


def keeps_up(y: np.ndarray, *, max_starved: float = 0.01, min_slo: float = 0.95) -> np.ndarray:
    """The twin's verdict per run: nothing starved and 95% of requests within the SLO bound."""
    return (y[:, 1] <= max_starved) & (y[:, 2] >= min_slo)


@dataclass
class PerfModel:
    """A regression forest for the targets and a classification forest for `keeps_up`: averaged
    regression outputs blur a hard threshold (a starvation of 0.02 predicted where none occurs), so
    placement asks the classifier."""

    forest: RandomForestRegressor
    verdict: RandomForestClassifier

    @staticmethod
    def train(x: np.ndarray, y: np.ndarray, seed: int = 0) -> "PerfModel":
        kw = dict(n_estimators=100, min_samples_leaf=2, random_state=seed, n_jobs=1)
        return PerfModel(RandomForestRegressor(**kw).fit(x, y), RandomForestClassifier(**kw).fit(x, keeps_up(y)))

    def predict(self, adapters: AdapterSet, rate: float, lengths: tuple[float, float]) -> dict[str, float]:
        """The targets, and p_ok: the probability that the server keeps up."""
        x = np.array([features(adapters, rate, lengths)])
        out = dict(zip(TARGETS, map(float, self.forest.predict(x)[0])))
        classes = list(self.verdict.classes_)
        out["p_ok"] = float(self.verdict.predict_proba(x)[0][classes.index(True)]) if True in classes else 0.0
        return out

    def predict_many(self, x: np.ndarray) -> np.ndarray:
        return self.forest.predict(x)
