"""The methods in one process: serialized (vanilla split learning), PSL, GPSL, and GCPSL's
naive reference (clusters one after another, then averaged). The cluster-parallel GCPSL
runs under `unbroken run` (job.py) and shares `local_round` and `average` with it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from unbroken.split import clusters, data, partition
from unbroken.split.config import SplitConfig
from unbroken.split.model import SplitMLP, accuracy, build, split_step
from unbroken.split.plan import Federation, rounds


def federation(split: data.Split, cfg: SplitConfig, method: str,
               cluster_of: np.ndarray | None = None) -> Federation:
    """Partition the training set across cfg.clients; for GCPSL also assign clusters (by the
    method's suffix, or the explicit `cluster_of`)."""
    labels = split.y_train.numpy()
    parts = partition.partition(labels, cfg.clients, alpha=cfg.alpha, size_sigma=cfg.size_sigma, seed=cfg.seed)
    if method.startswith("gcpsl"):
        if cluster_of is None:
            counts = partition.class_counts(labels, parts, split.n_classes)
            cluster_of = clusters.assign(counts, cfg.clusters, method.split("-", 1)[1], cfg.seed)
        elif len(cluster_of) != cfg.clients:
            raise clusters.SplitInputError(f"the assignment names {len(cluster_of)} clients but there are "
                                           f"{cfg.clients}; give one cluster id per client")
        cluster_of = clusters.check(cluster_of, cfg.clusters)
    return Federation(labels, tuple(parts), partition.owners(parts, len(labels)), split.n_classes, cluster_of)


def new_model(split: data.Split, cfg: SplitConfig) -> SplitMLP:
    return build(split.n_features, split.n_classes, cfg.hidden, cfg.seed)


def _sgd(model: SplitMLP, cfg: SplitConfig) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)


def local_round(start: dict, batches, split: data.Split, cfg: SplitConfig) -> SplitMLP:
    """One cluster's round: GPSL steps from the merged weights `start`, a fresh local optimizer."""
    model = new_model(split, cfg)
    model.load_state_dict(start)
    opt = _sgd(model, cfg)
    for b in batches:
        if len(b):
            split_step(model, opt, split.x_train[b], split.y_train[b])
    return model


def average(states: list[dict]) -> dict:
    """The merge: every client- and server-segment tensor averaged over the clusters."""
    return {k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}


@dataclass
class Curve:
    """Validation accuracy after each round against training time (evaluation not counted)."""
    points: list[tuple[int, float, float]] = field(default_factory=list)  # (round, train_s, accuracy)

    def time_to(self, target: float) -> float | None:
        return next((t for _, t, a in self.points if a >= target), None)

    @property
    def final(self) -> float:
        return self.points[-1][2] if self.points else float("nan")


def run(method: str, split: data.Split, cfg: SplitConfig, fed: Federation,
        stop: Callable[[float], bool] | None = None) -> tuple[Curve, SplitMLP]:
    """Train `method` in this process for the config's rounds (or until stop(accuracy))."""
    model = new_model(split, cfg)
    opt = _sgd(model, cfg)
    curve, train_s = Curve(), 0.0
    for rd in rounds(method, fed, cfg):
        t0 = time.perf_counter()
        if method.startswith("gcpsl"):
            start = model.state_dict()
            model.load_state_dict(average([local_round(start, b, split, cfg).state_dict() for b in rd.batches]))
        else:
            for b in rd.batches[0]:
                if len(b):
                    split_step(model, opt, split.x_train[b], split.y_train[b])
        train_s += time.perf_counter() - t0
        curve.points.append((rd.index, train_s, accuracy(model, split.x_val, split.y_val)))
        if stop is not None and stop(curve.final):
            break
    return curve, model
