"""A short profiling run that fits the twin's costs: a synthetic load (rising rates, mixed ranks) is
sent to a real server; its own log of iterations (rows, padded length, largest rank, adapter loads,
seconds, CPU seconds) gives the CPU cost by non-negative least squares and the spread of wall / CPU
(the box's contention, GIL waits) as quantiles; its log of admissions gives the hand-off and wake-up
delays, and the HTTP round trip is the median of client minus server latency. Measured under load,
as the server will run."""
from __future__ import annotations

import json
import statistics
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from unbroken.serve.adapters import write_adapter
from unbroken.serve.client import replay
from unbroken.serve.config import serve_model
from unbroken.serve.twin import Costs
from unbroken.serve.workload import AdapterSet, Arrival, generate

PROFILE_RATES = (1.0, 4.0, 10.0)  # req/s, one phase each: from lone requests to full batches
SLOWDOWN_QUANTILES = 20
MIN_FRESH = 5  # first-after-idle iterations needed for their own slowdown quantiles


def profile_adapters() -> AdapterSet:
    return AdapterSet.zipf(8, 0.8, seed=999, prefix="prof")


def write_profile_adapters(root: Path) -> None:
    s = profile_adapters()
    for i, (name, rank) in enumerate(zip(s.names, s.ranks)):
        write_adapter(root, name, model=serve_model(), rank=rank, seed=900 + i)


def profiling_workload(phase_s: float) -> list[Arrival]:
    s, out = profile_adapters(), []
    for i, rate in enumerate(PROFILE_RATES):
        out += [Arrival(a.t + i * phase_s, a.adapter, a.prompt_len, a.gen_len)
                for a in generate(s, rate=rate, duration_s=phase_s, seed=50 + i)]
    return out


def fit(log: list, http_gaps: list[float], admissions: list | None = None) -> Costs:
    """Costs from iteration records [rows, length, rank, loads, seconds, CPU seconds, seconds since
    the engine was last idle], client-minus-server gaps and admission records [arrival to queued,
    idle wake-up or None].

    The CPU seconds carry the cost's shape (a preempted iteration's wall time says nothing about
    its rows and length); wall / CPU per iteration is kept as SLOWDOWN_QUANTILES equal-probability
    quantiles, so that the twin's short requests see the typical iteration and its long ones the
    mean; separately for the first iterations after idleness (`slowdown_fresh`, from all
    iterations when fewer than MIN_FRESH were logged)."""
    x = np.array([[1, b, b * length, b * length * r, n] for b, length, r, n, *_ in log], float)
    c, _ = nnls(x, np.array([rec[5] for rec in log], float))
    dispatch = [a[0] for a in admissions or []]
    wakes = [a[1] for a in admissions or [] if a[1] is not None]
    cpu_only = Costs(base=float(c[0]), row=float(c[1]), token=float(c[2]), lora=float(c[3]), load=float(c[4]),
                     http=_median(http_gaps), dispatch=_median(dispatch), wake=_median(wakes))
    return observed_slowdown(cpu_only, log)


def observed_slowdown(costs: Costs, log: list) -> Costs:
    """`costs` with the slowdown quantiles of another iteration log (the CPU costs kept)."""
    fresh = [rec for rec in log if rec[6] == 0]
    return replace(costs, slowdown=slowdown_quantiles([rec for rec in log if rec[6] > 0] or log, costs),
                   slowdown_fresh=slowdown_quantiles(fresh if len(fresh) >= MIN_FRESH else log, costs))


def slowdown_quantiles(log: list, costs: Costs) -> tuple[float, ...]:
    """Wall seconds over the CPU seconds `costs` predict, per logged iteration, as equal-probability
    quantiles."""
    x = np.array([costs.iteration(b, length, r) + n * costs.load for b, length, r, n, *_ in log], float)
    wall = np.array([rec[4] for rec in log], float)
    q = np.quantile(wall / np.maximum(x, 1e-9), (np.arange(SLOWDOWN_QUANTILES) + 0.5) / SLOWDOWN_QUANTILES)
    return tuple(float(v) for v in np.maximum(q, 1e-3))


def server_log(server_url: str) -> dict:
    """The server's recent iterations and admissions (GET /v1/iterations)."""
    with urllib.request.urlopen(server_url + "/v1/iterations", timeout=10) as r:
        return json.loads(r.read())


def log_since(before: dict, after: dict, key: str) -> list:
    """The `key` ("iterations" or "admissions") records logged between two looks at a server."""
    n = after[f"{key}_total"] - before[f"{key}_total"]
    assert n <= len(after[key]), f"{n} {key} since the last look, the server keeps {len(after[key])}: look more often"
    return after[key][len(after[key]) - n:] if n else []


def _median(xs: list[float]) -> float:
    return max(0.0, statistics.median(xs)) if xs else 0.0


@dataclass(frozen=True)
class Profile:
    """What one profiling run measured: the server's iteration and admission records it caused and
    the client-minus-server latency of each profiling request."""

    iterations: list
    admissions: list
    http_gaps: list[float]


def profile(server_url: str, *, phase_s: float = 4.0) -> Profile:
    """Profile the server at `server_url` (its adapter directory must hold `write_profile_adapters`');
    only what the profiling requests made the server log is kept. The server must be otherwise idle."""
    before = server_log(server_url)
    results = replay(server_url, profiling_workload(phase_s), timeout_s=30.0)
    bad = [r.status for r in results if r.status != 200]
    assert not bad, f"profiling requests failed with statuses {sorted(set(bad))}"
    after = server_log(server_url)
    return Profile(log_since(before, after, "iterations"), log_since(before, after, "admissions"),
                   [r.e2e_s - r.server_e2e_s for r in results])


def fit_profiles(*profiles: Profile) -> Costs:
    """The twin's costs from one or more profiling runs, pooled."""
    return fit([x for p in profiles for x in p.iterations], [x for p in profiles for x in p.http_gaps],
               [x for p in profiles for x in p.admissions])


def fit_costs(server_url: str, *, phase_s: float = 4.0) -> Costs:
    """Profile the server at `server_url` and fit the twin's costs."""
    return fit_profiles(profile(server_url, phase_s=phase_s))
