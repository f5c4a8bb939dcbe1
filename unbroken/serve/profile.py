"""A short profiling run that fits the twin's costs: a synthetic load (rising rates, mixed ranks) is
sent to a real server; its own log of iterations (rows, padded length, largest rank, adapter loads,
seconds) is fitted by non-negative least squares, and the HTTP round trip is the median of client
minus server latency. Measured under load, as the server will run."""
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


def fit(log: list, http_gaps: list[float]) -> Costs:
    """Costs from iteration records [rows, length, rank, loads, seconds] and client-minus-server gaps."""
    x = np.array([[1, b, b * length, b * length * r, n] for b, length, r, n, _ in log], float)
    y = np.array([rec[-1] for rec in log], float)
    c, _ = nnls(x, y)
    return Costs(base=float(c[0]), row=float(c[1]), token=float(c[2]), lora=float(c[3]), load=float(c[4]),
                 http=max(0.0, statistics.median(http_gaps)) if http_gaps else 0.0)


def fit_costs(server_url: str, *, phase_s: float = 4.0) -> Costs:
    """Profile the server at `server_url` (its adapter directory must hold `write_profile_adapters`')."""
    results = replay(server_url, profiling_workload(phase_s), timeout_s=30.0)
    bad = [r.status for r in results if r.status != 200]
    assert not bad, f"profiling requests failed with statuses {sorted(set(bad))}"
    with urllib.request.urlopen(server_url + "/v1/iterations", timeout=10) as r:
        log = json.loads(r.read())["iterations"]
    return fit(log, [r.e2e_s - r.server_e2e_s for r in results])
