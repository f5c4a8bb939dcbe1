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
    """`lengths`: the workload's mean prompt and output lengths. First-fit decreasing finds how few
    servers the model allows; the adapters are then spread over that many servers by load (most
    popular first, each to the least loaded), kept if the model says every server keeps up: a
    server filled to the model's boundary has no headroom for its error."""
    packed, all_fit = _first_fit(model, cfg, adapters, total_rate, max_servers, lengths)
    balanced = _balanced(adapters, servers_used(packed))
    if not all_fit or all(fits(model, cfg, adapters, h, total_rate, lengths=lengths) for h in balanced):
        return balanced
    return packed


def _share(adapters: AdapterSet, names: list[str]) -> float:
    return sum(adapters.popularity[adapters.names.index(n)] for n in names)


def _by_popularity(adapters: AdapterSet) -> list[str]:
    return sorted(adapters.names, key=lambda n: -adapters.popularity[adapters.names.index(n)])


def _first_fit(model, cfg, adapters: AdapterSet, total_rate: float, max_servers: int, lengths) -> tuple[Placement, bool]:
    """Most popular adapter first, each onto the first open server that still fits; a new server only
    when none does. With every server open and none fitting: the least loaded one (all_fit False)."""
    out: Placement = []
    all_fit = True
    for name in _by_popularity(adapters):
        for hosted in out:
            if fits(model, cfg, adapters, hosted + [name], total_rate, lengths=lengths):
                hosted.append(name)
                break
        else:
            if len(out) < max_servers:
                out.append([name])
            else:
                all_fit = False
                min(out, key=lambda h: _share(adapters, h)).append(name)
    return out, all_fit


def _balanced(adapters: AdapterSet, servers: int) -> Placement:
    out: Placement = [[] for _ in range(servers)]
    for name in _by_popularity(adapters):
        min(out, key=lambda h: _share(adapters, h)).append(name)
    return out


def servers_used(p: Placement) -> int:
    return sum(1 for hosted in p if hosted)
