"""The simulated cluster (GPUs, nodes, spare pool) and its seeded failure trace.

Failures form a Poisson process over the whole job at N x (per-GPU rate); the trace is a
function of (seed, gpus) only, so every policy sees the same failures (common random numbers).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from unbroken.sim.errors import need
from unbroken.sim.rates import FailureMix

SPARE_FRACTION = 0.01


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """N GPUs in nodes of `node_size`, run for `days`.

    `spares` hot spare nodes (None: 1% of nodes, at least 2) stand by; a replaced node is
    back in the pool after `repair_h` hours. With the pool empty the scheduler finds a node
    elsewhere in the data center, which takes `provision_s`.
    """

    gpus: int
    node_size: int = 8
    days: float = 30.0
    spares: int | None = None
    repair_h: float = 48.0
    provision_s: float = 600.0

    def __post_init__(self) -> None:
        need(isinstance(self.gpus, int) and not isinstance(self.gpus, bool) and self.gpus >= 1,
             f"--gpus must be an integer >= 1, got {self.gpus!r}")
        need(isinstance(self.node_size, int) and not isinstance(self.node_size, bool) and self.node_size >= 1,
             f"--node-size must be an integer >= 1, got {self.node_size!r}")
        need(self.gpus % self.node_size == 0,
             f"--node-size {self.node_size} does not divide --gpus {self.gpus}; use a multiple of "
             f"{self.node_size} such as {max(self.node_size, self.gpus // self.node_size * self.node_size)}")
        need(isinstance(self.days, (int, float)) and math.isfinite(self.days) and self.days > 0,
             f"--days must be a number > 0, got {self.days!r}")
        if self.spares is not None:
            need(isinstance(self.spares, int) and self.spares >= 0,
                 f"--spares must be an integer >= 0, got {self.spares!r}")
        need(isinstance(self.repair_h, (int, float)) and math.isfinite(self.repair_h) and self.repair_h >= 0,
             f"--repair-h must be a number >= 0, got {self.repair_h!r}")
        need(isinstance(self.provision_s, (int, float)) and math.isfinite(self.provision_s)
             and self.provision_s >= 0, f"--provision-s must be a number >= 0, got {self.provision_s!r}")

    @property
    def nodes(self) -> int:
        return self.gpus // self.node_size

    @property
    def horizon_s(self) -> float:
        return self.days * 86400.0

    @property
    def spare_nodes(self) -> int:
        if self.spares is not None:
            return self.spares
        return max(2, math.ceil(SPARE_FRACTION * self.nodes))


@dataclass(frozen=True)
class Trace:
    """Failure times (s, sorted), class index into the mix, node and local GPU of each failure."""

    times: np.ndarray
    cls: np.ndarray
    node: np.ndarray
    gpu: np.ndarray

    def __len__(self) -> int:
        return int(self.times.shape[0])


def make_trace(cluster: Cluster, mix: FailureMix, seed: int) -> Trace:
    """Draw all failures of one run at once (vectorized)."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), cluster.gpus]))
    rate_s = mix.rate_per_gpu_hour() * cluster.gpus / 3600.0
    n = int(rng.poisson(rate_s * cluster.horizon_s))
    times = np.sort(rng.uniform(0.0, cluster.horizon_s, n))
    cls = rng.choice(len(mix.classes), size=n, p=np.asarray(mix.probabilities()))
    node = rng.integers(0, cluster.nodes, n)
    gpu = rng.integers(0, cluster.node_size, n)
    return Trace(times=times, cls=cls, node=node, gpu=gpu)


class SparePool:
    """Hot spare nodes: a replaced node takes one and goes to repair; an empty pool costs `provision_s`."""

    def __init__(self, spares: int, repair_s: float, provision_s: float) -> None:
        self.size, self.free = spares, spares
        self.repair_s, self.provision_s = repair_s, provision_s
        self._back: list[float] = []  # times repaired nodes return to the pool

    def take(self, t: float) -> float:
        """A node fails at t: it goes to repair and the job takes a spare; returns the wait (0 if one was free)."""
        while self._back and self._back[0] <= t:
            heapq.heappop(self._back)
            self.free = min(self.size, self.free + 1)
        heapq.heappush(self._back, t + self.repair_s)
        if self.free > 0:
            self.free -= 1
            return 0.0
        return self.provision_s
