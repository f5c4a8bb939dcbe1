"""A short profiling run that fits the twin's costs: iterations over a grid of batch sizes, lengths
and ranks (timed inside a real server, from its inter-token latencies, or in this process), adapter
loads per rank, and the HTTP round trip of a real server."""
from __future__ import annotations

import statistics
import tempfile
import time
import json
import urllib.request
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import nnls

from unbroken.serve.adapters import write_adapter
from unbroken.serve.config import ServeConfig, serve_model
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


def _server_samples(url: str, cfg: ServeConfig, gen: int = 6) -> list[tuple[int, int, int, float]]:
    """Batches of b simultaneous requests (prompt length L, adapter of rank r) sent to a real server;
    its per-request inter-token latency is the iteration time of that batch."""
    import asyncio

    import aiohttp

    async def batch(session, b: int, length: int, r: int) -> float:
        body = {"model": f"p{r}" if r else "base", "prompt": "a" * length, "max_tokens": gen}
        async def one():
            async with session.post(url + "/v1/completions", json=body) as resp:
                return (await resp.json())["metrics"]["itl_s"]
        return statistics.median(await asyncio.gather(*(one() for _ in range(b))))

    async def run():
        out = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            for b in (x for x in GRID_B if x <= cfg.max_batch):
                for length in GRID_L:
                    for r in GRID_R:
                        out.append((b, length + gen // 2, r, await batch(session, b, length, r)))
        return out

    return asyncio.run(run())


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


def write_profile_adapters(root: Path) -> None:
    for r in GRID_R[1:]:
        write_adapter(root, f"p{r}", model=serve_model(), rank=r, seed=r)


def fit_costs(cfg: ServeConfig, *, server_url: str | None = None, reps: int = 3) -> Costs:
    """Profile and fit (non-negative least squares). With `server_url` (a server whose adapter
    directory holds p4, p8, p16: `write_profile_adapters`) iterations and the HTTP cost are measured
    on it; without, iterations are timed here and the HTTP cost is 0."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        write_profile_adapters(Path(tmp))
        engine = Engine(cfg, Path(tmp))
        samples = [] if server_url else _iteration_samples(engine, reps)
        loads = []
        for _ in range(reps):
            for r in GRID_R[1:]:
                t = time.perf_counter()
                engine._load_slot(f"p{r}", 1)
                loads.append((r, time.perf_counter() - t))
    if server_url:
        samples = _server_samples(server_url, cfg)
    x = np.array([[1, b, b * length, b * length * r] for b, length, r, _ in samples], float)
    y = np.array([s[-1] for s in samples])
    it, _ = nnls(x, y)
    lr, _ = nnls(np.array([[1, r] for r, _ in loads], float), np.array([t for _, t in loads]))
    costs = Costs(*map(float, it), float(lr[0]), float(lr[1]), 0.0)
    if server_url:
        costs = Costs(**{**costs.as_dict(), "http": _http_round_trip(server_url, costs)})
    return costs
