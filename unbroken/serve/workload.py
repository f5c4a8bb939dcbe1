"""Workloads for one server or a fleet: the shipped Azure LLM traces (scaled to the tiny model) and
a generator (Poisson or bursty arrivals, heavy-tailed lengths); adapter popularity is Zipf-skewed
with mixed ranks (no public per-adapter trace exists)."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime
from importlib import resources

import numpy as np

from unbroken.config import ConfigError

PROMPT_MAX, GEN_MAX = 40, 24  # prompt + output fit the tiny model's 64-token context
CTX_PER_TOKEN, GEN_PER_TOKEN = 128, 24  # trace tokens per tiny-model token
RANKS = (4, 8, 16)
TRACES = ("conv", "code")


@dataclass(frozen=True)
class Arrival:
    t: float  # seconds from the start
    adapter: str
    prompt_len: int
    gen_len: int


@dataclass(frozen=True)
class AdapterSet:
    """n adapters, their ranks and their popularity (probabilities summing to 1, Zipf(alpha))."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]
    popularity: tuple[float, ...]

    @staticmethod
    def zipf(n: int, alpha: float, *, seed: int, prefix: str = "ad") -> "AdapterSet":
        if n < 1 or alpha < 0:
            raise ConfigError(f"need n >= 1 adapters and Zipf alpha >= 0, got n={n}, alpha={alpha}")
        rng = np.random.default_rng(seed)
        w = 1.0 / np.arange(1, n + 1) ** alpha
        ranks = rng.choice(RANKS, size=n)
        return AdapterSet(tuple(f"{prefix}{i:03d}" for i in range(n)), tuple(int(r) for r in ranks),
                          tuple(float(x) for x in w / w.sum()))

    def subset(self, names: list[str]) -> "AdapterSet":
        """These adapters, their popularity renormalized (what one server of a fleet sees)."""
        i = [self.names.index(n) for n in names]
        p = np.array([self.popularity[j] for j in i])
        return AdapterSet(tuple(names), tuple(self.ranks[j] for j in i), tuple(float(x) for x in p / p.sum()))


def load_trace(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival seconds from the first, context tokens, generated tokens) of a shipped trace."""
    if name not in TRACES:
        raise ConfigError(f"unknown trace {name!r}: use one of {', '.join(TRACES)}")
    text = resources.files("unbroken.serve").joinpath(f"data/azure_{name}.csv").read_text()
    rows = list(csv.DictReader(text.splitlines()))
    ts = np.array([datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() for r in rows])
    return ts - ts[0], np.array([int(r["ContextTokens"]) for r in rows]), np.array([int(r["GeneratedTokens"]) for r in rows])


def from_trace(name: str, adapters: AdapterSet, *, rate: float, duration_s: float, seed: int) -> list[Arrival]:
    """A `duration_s` window of the trace (where it starts is drawn from `seed`), time rescaled so that the
    whole subset's mean rate is `rate` req/s; adapters drawn from the set's popularity."""
    t, ctx, gen = load_trace(name)
    t = t * (len(t) / t[-1]) / rate
    start = np.random.default_rng(seed).uniform(0, max(0.0, t[-1] - duration_s))
    t = t - start
    keep = (t >= 0) & (t < duration_s)
    prompt = np.clip(np.ceil(ctx[keep] / CTX_PER_TOKEN), 1, PROMPT_MAX).astype(int)
    out = np.clip(np.ceil(gen[keep] / GEN_PER_TOKEN), 1, GEN_MAX).astype(int)
    return _with_adapters(t[keep], prompt, out, adapters, seed)


def generate(adapters: AdapterSet, *, rate: float, duration_s: float, seed: int, bursty: bool = False,
             prompt_median: float = 10.0, gen_median: float = 8.0) -> list[Arrival]:
    """Poisson arrivals (or bursty: gamma gaps with coefficient of variation 3) at `rate` req/s;
    lognormal (heavy-tailed) prompt and output lengths around the medians, clipped to the context."""
    if rate <= 0 or duration_s <= 0:
        raise ConfigError(f"rate and duration must be > 0, got rate={rate}, duration={duration_s}")
    rng = np.random.default_rng(seed)
    n = int(rate * duration_s * 1.5) + 16
    gaps = rng.gamma(1 / 9, 9 / rate, n) if bursty else rng.exponential(1 / rate, n)
    t = np.cumsum(gaps)
    t = t[t < duration_s]
    prompt = np.clip(np.round(rng.lognormal(math.log(prompt_median), 0.8, len(t))), 1, PROMPT_MAX).astype(int)
    out = np.clip(np.round(rng.lognormal(math.log(gen_median), 0.7, len(t))), 1, GEN_MAX).astype(int)
    return _with_adapters(t, prompt, out, adapters, seed + 1)


def _with_adapters(t, prompt, out, adapters: AdapterSet, seed: int) -> list[Arrival]:
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(adapters.names), size=len(t), p=np.array(adapters.popularity))
    return [Arrival(float(a), adapters.names[i], int(p), int(g)) for a, i, p, g in zip(t, pick, prompt, out)]
