"""What a run of a server (real or twin) comes to: throughput, latency percentiles, starvation and
SLO attainment, from per-request (arrival, finish, queueing, tokens) records."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Outcome:
    requests: int
    throughput_tok_s: float  # output tokens / (last finish - first arrival)
    p50_s: float  # end-to-end latency
    p95_s: float
    starved: float  # fraction queued longer than the starvation bound, or never served
    slo: float  # fraction finished within the SLO bound

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(arrive, finish, queue, tokens, ok, *, starve_s: float, slo_s: float) -> Outcome:
    """Arrays per request; a failed request (ok False) counts as starved and outside the SLO."""
    arrive, finish, queue = (np.asarray(x, float) for x in (arrive, finish, queue))
    tokens, ok = np.asarray(tokens, float), np.asarray(ok, bool)
    if not len(arrive):
        return Outcome(0, 0.0, 0.0, 0.0, 0.0, 1.0)
    lat = finish - arrive
    span = (finish[ok].max() - arrive.min()) if ok.any() else float("nan")
    good = lat[ok] if ok.any() else np.array([np.inf])
    return Outcome(len(arrive), float(tokens[ok].sum() / span) if ok.any() else 0.0,
                   float(np.percentile(good, 50)), float(np.percentile(good, 95)),
                   float(np.mean(~ok | (queue > starve_s))), float(np.mean(ok & (lat <= slo_s))))
