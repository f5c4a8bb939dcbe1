"""A short profiling run that fits the twin's costs: engine iterations over a grid of batch sizes,
lengths and ranks, adapter loads per rank (in this process, one thread, as a server runs), and the
HTTP round trip measured against a real server."""
from __future__ import annotations

import statistics
import tempfile
import time
import urllib.request
import json
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import nnls

from unbroken.serve.adapters import write_adapter
from unbroken.serve.config import ServeConfig
from unbroken.serve.engine import Engine, Request
from unbroken.serve.twin import Costs

GRID_B, GRID_L, GRID_R = (1, 2, 4, 8), (8, 24, 48), (0, 4, 16)


def _iteration_samples(engine: Engine, reps: int) -> list[tuple[int, int, int, float]]:
    out = []
    for b in GRID_B:
        if b > engine.cfg.max_batch:
            continue
        for length in GRID_L:
            for r in GRID_R:
                adapter = None if r == 0 else f"p{r}"
                for _ in range(b):
                    engine.submit(Request(adapter, [1] * length, reps + 1))
                engine.step()  # admission and loads happen here
                for _ in range(reps):
                    t = time.perf_counter()
                    engine.step()
                    out.append((b, length + 1, r, time.perf_counter() - t))
                engine.run_until_idle()
    return out


def _http_round_trip(url: str, costs_wo_http: Costs, n: int = 8) -> float:
    gaps = []
    for _ in range(n):
        body = json.dumps({"model": "base", "prompt": "a", "max_tokens": 1}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
        gaps.append(time.perf_counter() - t - costs_wo_http.iteration(1, 1, 0))
    return max(0.0, statistics.median(gaps))


def fit_costs(cfg: ServeConfig, *, server_url: str | None = None, reps: int = 3) -> Costs:
    """Profile and fit (non-negative least squares). Without `server_url` the HTTP cost is 0."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        from unbroken.serve.config import serve_model

        for r in GRID_R[1:]:
            write_adapter(Path(tmp), f"p{r}", model=serve_model(), rank=r, seed=r)
        engine = Engine(cfg, Path(tmp))
        samples = _iteration_samples(engine, reps)
        loads = []
        for _ in range(reps):
            for r in GRID_R[1:]:
                t = time.perf_counter()
                engine._load_slot(f"p{r}", 1)
                loads.append((r, time.perf_counter() - t))
    x = np.array([[1, b, b * length, b * length * r] for b, length, r, _ in samples], float)
    y = np.array([s[-1] for s in samples])
    it, _ = nnls(x, y)
    lr, _ = nnls(np.array([[1, r] for r, _ in loads], float), np.array([t for _, t in loads]))
    costs = Costs(*map(float, it), float(lr[0]), float(lr[1]), 0.0)
    if server_url:
        costs = Costs(**{**costs.as_dict(), "http": _http_round_trip(server_url, costs)})
    return costs
