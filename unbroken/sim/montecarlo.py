"""Monte-Carlo over seeds (mean and 95% confidence interval) and the sweep over cluster sizes.

All policies of one seed share one failure trace, so their differences are not noise.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from unbroken.sim.cluster import Cluster, make_trace
from unbroken.sim.costs import Workload
from unbroken.sim.engine import ACCOUNTS, RunResult, run_policy
from unbroken.sim.errors import need
from unbroken.sim.policies import Policy
from unbroken.sim.rates import FailureMix

# Two-sided 95% Student-t quantiles for 1..30 degrees of freedom; beyond that, the normal 1.96.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)
SWEEP_START = 1024


def mean_ci95(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) of a 95% Student-t interval; a single value has a zero-width interval."""
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, m, m
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    h = (_T95[n - 2] if n - 1 <= len(_T95) else 1.96) * sd / math.sqrt(n)
    return m, m - h, m + h


@dataclass(frozen=True)
class Summary:
    """One policy at one cluster size, over `seeds` runs. `ettr` is net of the policy's failure-free
    `overhead`; `ettr_gross` is the same runs before it is taken out."""

    policy: str
    gpus: int
    days: float
    seeds: int
    mttf_h: float
    ettr: float
    ettr_low: float
    ettr_high: float
    failures: float
    tier2: float
    phases_h: dict[str, float]
    ettr_gross: float = 0.0
    overhead: float = 0.0
    failure_free_overhead: float = 0.0

    @property
    def lost_work_h(self) -> float:
        return self.phases_h["redo"]

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "gpus": self.gpus, "days": self.days, "seeds": self.seeds,
                "ettr": round(self.ettr, 6), "ettr_ci95": [round(self.ettr_low, 6), round(self.ettr_high, 6)],
                "ettr_gross": round(self.ettr_gross, 6), "overhead": round(self.overhead, 6),
                "failure_free_overhead": round(self.failure_free_overhead, 6),
                "failures": round(self.failures, 2), "mttf_h": round(self.mttf_h, 4),
                "lost_work_h": round(self.lost_work_h, 3), "tier2_recoveries": round(self.tier2, 2),
                "phases_h": {k: round(v, 3) for k, v in self.phases_h.items()}}


def summarize(runs: list[RunResult], mttf_h: float) -> Summary:
    r0 = runs[0]
    m, lo, hi = mean_ci95([r.ettr for r in runs])
    lo, hi = max(0.0, lo), min(1.0, hi)  # ETTR is a fraction; a wide t-interval must not leave [0, 1]
    n = len(runs)
    phases = {k: sum(r.time_s[k] for r in runs) / n / 3600.0 for k in ACCOUNTS}
    return Summary(policy=r0.policy, gpus=r0.gpus, days=r0.days, seeds=n, mttf_h=mttf_h, ettr=m, ettr_low=lo,
                   ettr_high=hi, failures=sum(r.failures for r in runs) / n,
                   tier2=sum(r.tier2 for r in runs) / n, phases_h=phases,
                   ettr_gross=sum(r.ettr_gross for r in runs) / n, overhead=r0.overhead,
                   failure_free_overhead=r0.failure_free_overhead)


def monte_carlo(policies: Mapping[str, Policy], cluster: Cluster, mix: FailureMix, workload: Workload, *,
                seeds: int, seed: int = 0) -> list[Summary]:
    """Run every policy on seeds seed, seed+1, ...; one Summary per policy, in the order given."""
    need(isinstance(seeds, int) and seeds >= 1, f"--seeds must be an integer >= 1, got {seeds!r}")
    runs: dict[str, list[RunResult]] = {name: [] for name in policies}
    for s in range(seed, seed + seeds):
        trace = make_trace(cluster, mix, s)
        for name, pol in policies.items():
            runs[name].append(run_policy(pol, cluster, mix, workload, s, trace=trace))
    mttf_h = mix.mttf_hours(cluster.gpus)
    return [summarize(runs[name], mttf_h) for name in policies]


def sweep_sizes(max_gpus: int, node_size: int) -> list[int]:
    """1,024, 2,048, ... up to max_gpus (included), each rounded down to whole nodes."""
    sizes, s = [], SWEEP_START
    while s < max_gpus:
        sizes.append(max(node_size, s // node_size * node_size))
        s *= 2
    sizes.append(max_gpus)
    return sorted(set(sizes))


def sweep(policies: Mapping[str, Policy], cluster: Cluster, mix: FailureMix, workload: Workload, *,
          seeds: int, seed: int = 0) -> dict[str, list[Summary]]:
    """Monte-Carlo at each sweep size up to cluster.gpus; {policy: [Summary per size]}."""
    out: dict[str, list[Summary]] = {name: [] for name in policies}
    for g in sweep_sizes(cluster.gpus, cluster.node_size):
        at = dataclasses.replace(cluster, gpus=g)
        for summ in monte_carlo(policies, at, mix, workload, seeds=seeds, seed=seed):
            out[summ.policy].append(summ)
    return out
