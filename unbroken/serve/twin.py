"""The digital twin of one server: a discrete-event replay of the engine's policy (FIFO with
skip-ahead admission, the same LRU adapter cache, continuous batching, one token per running request
per iteration) with per-iteration and per-load costs fitted from a profiling run (`profile.py`)."""
from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from unbroken.serve.cache import AdapterCache
from unbroken.serve.config import ServeConfig, memory_bytes, serve_model
from unbroken.serve.outcome import Outcome, summarize
from unbroken.serve.workload import AdapterSet, Arrival


@dataclass(frozen=True)
class Costs:
    """Seconds: an iteration of B rows padded to L tokens whose largest adapter rank is r takes
    base + row*B + token*B*L + lora*B*L*r of the engine's CPU, loading an adapter into a slot `load`;
    the wall time of an iteration is that times a factor drawn from `slowdown` (wall / CPU per
    iteration as profiled: the core's share left by other processes, waits for the GIL), so a twin
    run sees the profiled spread of iteration times and not only their mean. The first iteration
    after the engine was idle draws from `slowdown_fresh` instead: the OS runs a process that
    slept at once, one that keeps running gets its share of a busy box.
    `http` is a request's round trip outside the engine (client, HTTP, event loop), `dispatch` the
    hand-off from the HTTP thread to the engine's queue, `wake` how long an idle engine takes to
    start on a queued request."""

    base: float
    row: float
    token: float
    lora: float
    load: float
    http: float
    dispatch: float = 0.0
    wake: float = 0.0
    slowdown: tuple[float, ...] = (1.0,)  # equal-probability quantiles
    slowdown_fresh: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        for f in (self.slowdown, self.slowdown_fresh):
            assert f and min(f) > 0, f"slowdown factors must be > 0, got {f}"

    def iteration(self, b: int, length: int, rank: int) -> float:
        """CPU seconds of one iteration (times a slowdown factor for its wall time)."""
        return self.base + self.row * b + self.token * b * length + self.lora * b * length * rank

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Req:
    arrival: float  # at the engine (after half the HTTP round trip)
    adapter: str
    rank: int
    length: int
    left: int
    gen: int
    start: float = float("nan")
    finish: float = float("nan")
    slot: int = 0


def simulate(cfg: ServeConfig, adapters: AdapterSet, arrivals: list[Arrival], costs: Costs,
             *, slo_s: float, timeout_s: float = 20.0, seed: int = 0) -> tuple[Outcome, dict]:
    """Predict one server's outcome for these arrivals; a request not finished `timeout_s` after it
    was sent fails, as in the real replay (and counts as starved). `seed` draws the iterations'
    slowdown factors. Returns (outcome, stats); stats["requests"] holds each request's (arrival at
    the engine, admission, finish) in the arrivals' order."""
    wall = time.perf_counter()
    rank = dict(zip(adapters.names, adapters.ranks))
    loads: list[float] = []
    cache = AdapterCache(cfg.slots, lambda name, slot: loads.append(costs.load))
    ahead = costs.http / 2 + costs.dispatch
    reqs = [_Req(a.t + ahead, a.adapter, rank[a.adapter], a.prompt_len, a.gen_len, a.gen_len) for a in arrivals]
    horizon = arrivals[-1].t + timeout_s if arrivals else 0.0
    pending, waiting, running = deque(reqs), deque(), []
    now, iterations = 0.0, 0
    draw = random.Random(seed).choice
    while (pending or waiting or running) and now < horizon:
        while pending and pending[0].arrival <= now:
            waiting.append(pending.popleft())
        if not running and not waiting:
            now = pending[0].arrival + costs.wake
            continue
        fresh = not running
        waiting = _admit(cfg, cache, waiting, running, now)
        if not running:  # every slot pinned cannot happen with nothing running
            continue
        cpu = sum(loads) + costs.iteration(len(running), max(r.length for r in running), max(r.rank for r in running))
        loads.clear()
        now += cpu * draw(costs.slowdown_fresh if fresh else costs.slowdown)
        iterations += 1
        keep = []
        for r in running:
            r.length, r.left = r.length + 1, r.left - 1
            if r.left:
                keep.append(r)
            else:
                r.finish = now + costs.http / 2
                cache.release(r.slot)
        running = keep
    out = summarize([a.t for a in arrivals], [r.finish for r in reqs],
                    [r.start - r.arrival if r.start == r.start else np.inf for r in reqs],
                    [r.gen for r in reqs], [r.finish - a.t <= timeout_s for r, a in zip(reqs, arrivals)],
                    starve_s=cfg.starve_s, slo_s=slo_s)
    model = serve_model()
    stats = {"iterations": iterations, "adapter_loads": cache.loads, "evictions": cache.evictions,
             "memory_mb": memory_bytes(model, cfg.max_batch, cfg.slots, cfg.max_rank) / 2**20,
             "wall_s": time.perf_counter() - wall, "requests": [(r.arrival, r.start, r.finish) for r in reqs]}
    return out, stats


def _admit(cfg: ServeConfig, cache: AdapterCache, waiting: deque, running: list, now: float) -> deque:
    """The engine's admission: FIFO, skipping requests whose adapter finds no free slot."""
    if len(running) >= cfg.max_batch:
        return waiting
    still = deque()
    while waiting:
        r = waiting.popleft()
        slot = cache.acquire(r.adapter) if len(running) < cfg.max_batch else None
        if slot is None:
            still.append(r)
            continue
        r.slot, r.start = slot, now
        running.append(r)
    return still
