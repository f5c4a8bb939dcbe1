"""The learned performance model: a scikit-learn random forest trained on twin runs, predicting a
server's throughput, starvation and p95 latency from (adapter count, ranks, popularity, rate)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.ensemble import RandomForestRegressor

from unbroken.serve.config import ServeConfig
from unbroken.serve.twin import Costs, simulate
from unbroken.serve.workload import RANKS, AdapterSet, generate

FEATURES = ("adapters", "mean_rank", "max_rank", "top_share", "concentration", "rate")
TARGETS = ("throughput_tok_s", "starved", "p95_s")


def features(adapters: AdapterSet, rate: float) -> list[float]:
    """What the forest sees of one server's share of the load: its adapters (count, ranks,
    popularity as the top share and sum of squares) and the request rate they receive."""
    p = np.array(adapters.popularity)
    r = np.array(adapters.ranks, float)
    return [len(p), float(r.mean()), float(r.max()), float(p.max()), float((p ** 2).sum()), rate]


def random_case(rng: np.random.Generator, max_adapters: int, max_rate: float) -> tuple[AdapterSet, float]:
    n = int(rng.integers(1, max_adapters + 1))
    w = 1.0 / np.arange(1, n + 1) ** rng.uniform(0.0, 1.6)
    w = rng.permutation(w / w.sum())
    ranks = rng.choice(RANKS, size=n)
    s = AdapterSet(tuple(f"ad{i:03d}" for i in range(n)), tuple(int(x) for x in ranks), tuple(float(x) for x in w))
    return s, float(rng.uniform(0.3, max_rate))


def twin_dataset(cfg: ServeConfig, costs: Costs, *, n: int, seed: int, slo_s: float, duration_s: float,
                 max_adapters: int, max_rate: float) -> tuple[np.ndarray, np.ndarray]:
    """n twin runs on random cases: (features, [throughput, starved, p95])."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for i in range(n):
        adapters, rate = random_case(rng, max_adapters, max_rate)
        arrivals = generate(adapters, rate=rate, duration_s=duration_s, seed=seed * 100003 + i)
        if not arrivals:
            continue
        out, _ = simulate(cfg, adapters, arrivals, costs, slo_s=slo_s)
        xs.append(features(adapters, rate))
        ys.append([out.throughput_tok_s, out.starved, min(out.p95_s, 4 * slo_s)])
    return np.array(xs), np.array(ys)


@dataclass
class PerfModel:
    forest: RandomForestRegressor

    @staticmethod
    def train(x: np.ndarray, y: np.ndarray, seed: int = 0) -> "PerfModel":
        return PerfModel(RandomForestRegressor(n_estimators=100, min_samples_leaf=2, random_state=seed,
                                               n_jobs=1).fit(x, y))

    def predict(self, adapters: AdapterSet, rate: float) -> dict[str, float]:
        y = self.forest.predict(np.array([features(adapters, rate)]))[0]
        return dict(zip(TARGETS, map(float, y)))

    def predict_many(self, x: np.ndarray) -> np.ndarray:
        return self.forest.predict(x)
