"""Naive reference for the engine's closed-form schedule walk: one save segment at a time (tests only)."""
from __future__ import annotations

from unbroken.sim.policies import Schedule


def naive_locate(s: Schedule, i0: int, dt: float) -> tuple[float, int, int]:
    """Resumed at fast index i0, dt seconds ago: (progress, last fast index saved, last slow index saved)."""
    i, slow, t = i0, i0 - i0 % s.slow_every, 0.0
    while True:
        if t + s.fast_interval_s > dt:  # failure while computing segment i
            return i * s.fast_interval_s + (dt - t), i, slow
        t += s.fast_interval_s
        persistent = (i + 1) % s.slow_every == 0
        cost = s.slow_cost_s if persistent else s.fast_cost_s
        if t + cost > dt:  # failure while saving: the segment is done but not saved
            return (i + 1) * s.fast_interval_s, i, slow
        t += cost
        i += 1
        if persistent:
            slow = i
