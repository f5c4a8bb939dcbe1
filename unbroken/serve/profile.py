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
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from unbroken.serve.adapters import write_adapter
from unbroken.serve.client import replay
from unbroken.serve.config import serve_model
from unbroken.serve.twin import Costs
from unbroken.serve.workload import AdapterSet, Arrival, generate

PROFILE_RATES = (1.0, 4.0, 10.0)  # req/s, one phase each: from lone requests to full batches


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


SLOWDOWN_QUANTILES = 20


def fit(log: list, http_gaps: list[float], admissions: list | None = None) -> Costs:
    """Costs from iteration records [rows, length, rank, loads, seconds, CPU seconds], client-minus-
    server gaps and admission records [arrival to queued, idle wake-up or None].

    The CPU seconds carry the cost's shape (a preempted iteration's wall time says nothing about
    its rows and length); wall / CPU per iteration is kept as SLOWDOWN_QUANTILES equal-probability
    quantiles, so that the twin's short requests see the typical iteration and its long ones the
    mean."""
    x = np.array([[1, b, b * length, b * length * r, n] for b, length, r, n, *_ in log], float)
    wall = np.array([rec[4] for rec in log], float)
    cpu = np.array([rec[5] for rec in log], float)
    c, _ = nnls(x, cpu)
    ratio = wall / np.maximum(x @ c, 1e-9)
    q = np.quantile(ratio, (np.arange(SLOWDOWN_QUANTILES) + 0.5) / SLOWDOWN_QUANTILES)
    dispatch = [a[0] for a in admissions or []]
    wakes = [a[1] for a in admissions or [] if a[1] is not None]
    return Costs(base=float(c[0]), row=float(c[1]), token=float(c[2]), lora=float(c[3]), load=float(c[4]),
                 http=_median(http_gaps), dispatch=_median(dispatch), wake=_median(wakes),
                 slowdown=tuple(float(v) for v in np.maximum(q, 1e-3)))


def _median(xs: list[float]) -> float:
    return max(0.0, statistics.median(xs)) if xs else 0.0


def fit_costs(server_url: str, *, phase_s: float = 4.0) -> Costs:
    """Profile the server at `server_url` (its adapter directory must hold `write_profile_adapters`')."""
    results = replay(server_url, profiling_workload(phase_s), timeout_s=30.0)
    bad = [r.status for r in results if r.status != 200]
    assert not bad, f"profiling requests failed with statuses {sorted(set(bad))}"
    with urllib.request.urlopen(server_url + "/v1/iterations", timeout=10) as r:
        logs = json.loads(r.read())
    return fit(logs["iterations"], [r.e2e_s - r.server_e2e_s for r in results], logs["admissions"])
