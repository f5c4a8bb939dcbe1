"""Per-request latency metrics (TTFT, inter-token latency, end-to-end, queueing, starvation) and
their Prometheus text exposition for GET /metrics."""
from __future__ import annotations

import bisect
import threading
from collections import Counter

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, v)] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [f"# TYPE {name} histogram"], 0
        for b, c in zip(BUCKETS, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.n}"]
        return out


class Metrics:
    """What finished requests measured; `render` adds the engine's live gauges."""

    def __init__(self, starve_s: float) -> None:
        self.starve_s = starve_s
        self.ttft, self.itl, self.e2e, self.queue = _Histogram(), _Histogram(), _Histogram(), _Histogram()
        self.requests: Counter[str] = Counter()
        self.tokens = 0
        self.starved = 0
        self.rejected = 0
        self._lock = threading.Lock()

    def record(self, r) -> None:
        with self._lock:
            self.requests[r.adapter or "base"] += 1
            self.tokens += len(r.out)
            self.ttft.observe(r.times[0] - r.arrival)
            self.e2e.observe(r.times[-1] - r.arrival)
            self.queue.observe(r.start - r.arrival)
            for a, b in zip(r.times, r.times[1:]):
                self.itl.observe(b - a)
            self.starved += (r.start - r.arrival) > self.starve_s

    def render(self, engine) -> str:
        with self._lock:
            lines = ["# TYPE unbroken_serve_requests_total counter"]
            lines += [f'unbroken_serve_requests_total{{adapter="{a}"}} {n}' for a, n in sorted(self.requests.items())]
            for name, v in (("tokens_total", self.tokens), ("starved_total", self.starved),
                            ("rejected_total", self.rejected), ("adapter_loads_total", engine.cache.loads),
                            ("adapter_evictions_total", engine.cache.evictions),
                            ("adapter_hits_total", engine.cache.hits), ("iterations_total", engine.iterations)):
                lines += [f"# TYPE unbroken_serve_{name} counter", f"unbroken_serve_{name} {v}"]
            for name, v in (("running", len(engine.running)), ("waiting", len(engine.waiting)),
                            ("adapters_resident", len(engine.cache.resident()))):
                lines += [f"# TYPE unbroken_serve_{name} gauge", f"unbroken_serve_{name} {v}"]
            for name, h in (("ttft_seconds", self.ttft), ("itl_seconds", self.itl), ("e2e_seconds", self.e2e),
                            ("queue_seconds", self.queue)):
                lines += h.lines(f"unbroken_serve_{name}")
        return "\n".join(lines) + "\n"
