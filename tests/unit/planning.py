"""Test helper: an adaptive all-reduce for planning alone (no group), every link read at one rate."""
from __future__ import annotations

from unbroken.comm.adaptive import AdaptiveAllreduce

FAST = 125e6  # bytes/s: a 1 Gbit/s link


def uniform(events: list, world: int = 4, rate: float = FAST) -> AdaptiveAllreduce:
    """Every link read three times at `rate`, something measured; rank 0's events into `events`."""
    a = AdaptiveAllreduce(None, rank=0, world=world, timeout_s=5, emit=lambda kind, **f: events.append((kind, f)))
    for _ in range(3):
        for r in range(world):
            for way in ("up", "down"):
                a.table.observe((way, r), rate)
    a._measured = True
    return a
