"""What an RL run measures: each process's role over time and its busy intervals, from which the
pools' idle fractions follow; the completion-length distribution; the reward curve summaries."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Timeline:
    """roles[w]: [(t, role)] changes (role "rollout" | "train" | "both" | "gone"); busy[w]: [(t0, t1)];
    lent[w]: the busy intervals in which a trainer generated for the rollout pool, helped[w]: those in
    which a rollout worker computed a training share (dynamic mode)."""
    roles: dict[int, list[tuple[float, str]]] = field(default_factory=dict)
    busy: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    lent: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    helped: dict[int, list[tuple[float, float]]] = field(default_factory=dict)

    def set_role(self, wid: int, t: float, role: str) -> None:
        self.roles.setdefault(wid, []).append((t, role))

    def role(self, wid: int) -> str:
        return self.roles[wid][-1][1]

    def add_busy(self, wid: int, t0: float, t1: float) -> None:
        self.busy.setdefault(wid, []).append((t0, t1))

    def add_lent(self, wid: int, t0: float, t1: float, to: str = "rollout") -> None:
        """Work for the other pool (`to`: a trainer's rollout, a rollout worker's training share): busy
        (it was not idle), and counted as that pool's work."""
        self.add_busy(wid, t0, t1)
        (self.lent if to == "rollout" else self.helped).setdefault(wid, []).append((t0, t1))

    def lent_seconds(self, t0: float, t1: float, to: str = "rollout") -> float:
        spans = (self.lent if to == "rollout" else self.helped).values()
        return sum(max(0.0, min(y, t1) - max(x, t0)) for s in spans for x, y in s)

    def _spans(self, wid: int, t_end: float) -> list[tuple[float, float, str]]:
        r = self.roles.get(wid, [])
        return [(t, (r[i + 1][0] if i + 1 < len(r) else t_end), role) for i, (t, role) in enumerate(r)]

    def pool_seconds(self, pool: str, t0: float, t1: float) -> tuple[float, float]:
        """(process-seconds spent in `pool`, of which busy) during [t0, t1]."""
        total = busy = 0.0
        for wid in self.roles:
            for a, b, role in self._spans(wid, t1):
                lo, hi = max(a, t0), min(b, t1)
                if role != pool or hi <= lo:
                    continue
                total += hi - lo
                busy += sum(max(0.0, min(y, hi) - max(x, lo)) for x, y in self.busy.get(wid, []))
        return total, busy

    def idle_fraction(self, pool: str, t0: float, t1: float) -> float | None:
        """Of the process-seconds spent in `pool` during [t0, t1], the fraction not busy (None: no time)."""
        total, busy = self.pool_seconds(pool, t0, t1)
        return None if total <= 0 else max(0.0, 1.0 - busy / total)

    def sizes(self, t_end: float) -> list[tuple[float, int, int]]:
        """(t, rollout processes, training processes) at every role change ("both" counts in each)."""
        changes = sorted({t for r in self.roles.values() for t, _ in r})
        out = []
        for t in changes:
            now = [self._role_at(w, t) for w in self.roles]
            out.append((t, sum(r in ("rollout", "both") for r in now), sum(r in ("train", "both") for r in now)))
        return out

    def _role_at(self, wid: int, t: float) -> str:
        role = "gone"
        for tc, r in self.roles[wid]:
            if tc <= t:
                role = r
        return role


def length_stats(lengths: list[int]) -> dict:
    """Completion lengths in tokens: mean, percentiles, max, and a histogram {length: count}."""
    xs = sorted(lengths)
    if not xs:
        return {}

    def pct(q: float) -> int:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    hist: dict[int, int] = {}
    for x in xs:
        hist[x] = hist.get(x, 0) + 1
    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
            "max": xs[-1], "histogram": {str(k): v for k, v in sorted(hist.items())}}


def smoothed(values: list[float], window: int = 5) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def time_to_target(curve: list[dict], target: float, window: int = 5) -> float | None:
    """Seconds from the run's start until the reward, smoothed over `window` steps, first reaches target."""
    sm = smoothed([c["reward"] for c in curve], window)
    return next((c["t"] for c, r in zip(curve, sm) if r >= target), None)
