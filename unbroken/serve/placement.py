"""Adapter placement onto a fleet: greedy (fewest servers such that the performance model predicts
no starvation, 95% of requests within the SLO bound and memory within the limit), round-robin and random."""
from __future__ import annotations

import numpy as np

from unbroken.serve.config import ServeConfig, memory_bytes, serve_model
from unbroken.serve.workload import AdapterSet

Placement = list[list[str]]  # per server, the adapters it hosts
# how sure the model must be that a server keeps up (more likely than not)
P_OK = 0.5


def round_robin(adapters: AdapterSet, servers: int) -> Placement:
    out: Placement = [[] for _ in range(servers)]
    for i, name in enumerate(adapters.names):
        out[i % servers].append(name)
    return out


def random_placement(adapters: AdapterSet, servers: int, seed: int) -> Placement:
    rng = np.random.default_rng(seed)
    out: Placement = [[] for _ in range(servers)]
    for name in adapters.names:
        out[int(rng.integers(servers))].append(name)
    return out


def fits(model, cfg: ServeConfig, adapters: AdapterSet, names: list[str], total_rate: float, *,
         lengths: tuple[float, float]) -> bool:
    """Does one server hosting `names` keep up, by the model's prediction?"""
    if memory_bytes(serve_model(), cfg.max_batch, cfg.slots, cfg.max_rank) > cfg.memory_mb * 2**20:
        return False
    share = sum(adapters.popularity[adapters.names.index(n)] for n in names)
    pred = model.predict(adapters.subset(names), total_rate * share, lengths)
    return pred["p_ok"] >= P_OK  # no starvation and p95 within the SLO bound, with a margin


def greedy(model, cfg: ServeConfig, adapters: AdapterSet, total_rate: float, max_servers: int, *,
           lengths: tuple[float, float]) -> Placement:
    """`lengths`: the workload's mean prompt and output lengths. Most popular adapter first, each onto the first open server that still fits (first-fit
    decreasing); a new server only when none does. With every server open and none fitting, the
    adapter goes where the predicted load is lowest."""
    order = sorted(adapters.names, key=lambda n: -adapters.popularity[adapters.names.index(n)])
    out: Placement = []
    for name in order:
        for hosted in out:
            if fits(model, cfg, adapters, hosted + [name], total_rate, lengths=lengths):
                hosted.append(name)
                break
        else:
            if len(out) < max_servers:
                out.append([name])
            else:
                load = [sum(adapters.popularity[adapters.names.index(n)] for n in h) for h in out]
                out[int(np.argmin(load))].append(name)
    return out


def servers_used(p: Placement) -> int:
    return sum(1 for hosted in p if hosted)
