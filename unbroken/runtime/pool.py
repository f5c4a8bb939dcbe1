"""How many warm shadows each node keeps (`shadows = "auto"`).

A shadow needs `warmup_s` (start the interpreter, import torch, build the model) before it
can take a rank; a failure that finds no warm shadow waits for a cold one. With failures
arriving every `gap` seconds, a pool of one is enough when gap > warmup_s; otherwise the
pool must hold one shadow per failure that can arrive during one warm-up, plus the one
the next failure takes: floor(warmup_s / gap) + 1.
`ShadowPoolSizer` keeps the recent failure times and the measured warm-ups and proposes
that size, clamped to [1, max_size]; it never shrinks below what it has proposed within
the last `hold_s` (a burst of failures is often followed by another).
"""
from __future__ import annotations

import math
import statistics
from collections import deque


class ShadowPoolSizer:
    def __init__(self, max_size: int, *, initial: int = 1, window: int = 8, hold_s: float = 600.0) -> None:
        self.max_size, self.hold_s = max_size, hold_s
        self.size = max(1, min(initial, max_size))
        self._failures: deque[float] = deque(maxlen=window)
        self._warmups: deque[float] = deque(maxlen=window)
        self._raised_at = -math.inf

    def warmed_up(self, seconds: float) -> None:
        self._warmups.append(seconds)

    def failure(self, now: float) -> int | None:
        """Record a failure at `now`; the new size when it changes, else None."""
        self._failures.append(now)
        want = self.proposal()
        if want > self.size or (want < self.size and now - self._raised_at > self.hold_s):
            if want > self.size:
                self._raised_at = now
            self.size = want
            return want
        return None

    def gap_s(self) -> float:
        """Median time between the recent failures (inf with fewer than two)."""
        t = list(self._failures)
        return statistics.median(b - a for a, b in zip(t, t[1:])) if len(t) >= 2 else math.inf

    def warmup_s(self) -> float:
        return max(self._warmups) if self._warmups else 0.0

    def proposal(self) -> int:
        if len(self._failures) < 2 or not self._warmups:
            return self.size
        # shadows still warming up when the next failure comes, plus the one it takes
        return max(1, min(self.max_size, math.floor(self.warmup_s() / max(self.gap_s(), 1e-3)) + 1))

    def resize(self, store, nnodes: int, events, now: float) -> None:
        """The leader, on a failure: read every node's measured warm-up, and publish (and
        record) a new size when the failure rate calls for one."""
        for n in range(nnodes):
            if store.check([f"warmup/{n}"]):
                self.warmed_up(float(store.get(f"warmup/{n}")))
        size = self.failure(now)
        if size is not None:
            store.set("shadows/size", str(size))
            events.emit("shadow_pool", node=None, size=size,
                        reason=f"failures every ~{self.gap_s():.1f}s, a shadow warms up in ~{self.warmup_s():.1f}s")
