"""The protection interval K (`protect_every`): how often tier-1 parity is brought up to date.

Parity every K steps costs about c/K per step (c: one parity step's extra time) and a
recovery replays at most K-1 logged steps of the lost shard (each about r, the update's
time). With failures every M seconds, the expected cost per second of training is
    c / (K * s)  +  (K / 2) * r / M
(s: a step's time), minimal at K* = sqrt(2 * c * M / (s * r)), bounded by the memory the
gradient ring may use (K full gradients per rank).
"""
from __future__ import annotations

import math
import os

DEFAULT_K = 8  # measured: `unbroken bench overhead` (docs/benchmarks.md)
MAX_K = 32


def best_interval(*, parity_s: float, step_s: float, replay_step_s: float, mtbf_s: float,
                  max_k: int = MAX_K) -> int:
    """K minimizing failure-free cost plus expected replay cost (see the module docstring)."""
    for name, v in (("parity_s", parity_s), ("step_s", step_s), ("replay_step_s", replay_step_s),
                    ("mtbf_s", mtbf_s)):
        if not v > 0 or math.isinf(v):
            raise ValueError(f"{name} must be a positive finite number of seconds, got {v!r}")
    k = math.sqrt(2.0 * parity_s * mtbf_s / (step_s * replay_step_s))
    return max(1, min(max_k, round(k)))


def largest_fitting(grad_bytes: int, budget_bytes: int) -> int:
    """The largest K whose gradient ring (K buffers of grad_bytes) fits in budget_bytes (0 if none)."""
    if grad_bytes <= 0:
        raise ValueError(f"grad_bytes must be > 0, got {grad_bytes}")
    return max(0, budget_bytes // grad_bytes)


def memory_budget_bytes(processes: int, fraction: float = 0.5) -> int:
    """What one process may give its gradient ring: `fraction` of the memory available now,
    shared by the `processes` of this node (workers and shadows)."""
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(avail * fraction / max(1, processes))


def ring_slots(protect_every: int | str, grad_bytes: int, budget_bytes: int) -> int:
    """Gradient buffers the ring needs: K, or for "auto" the largest K up to MAX_K that fits.
    Raises ValueError naming the largest K that fits when K does not."""
    fit = largest_fitting(grad_bytes, budget_bytes)
    if protect_every == "auto":
        if fit < 1:
            raise ValueError(f"protect_every auto: not even one gradient buffer ({grad_bytes >> 20} MB) fits in "
                             f"{budget_bytes >> 20} MB per process; use --protect-every 1 or free memory")
        return min(MAX_K, fit)
    k = int(protect_every)
    if k > fit:
        raise ValueError(f"protect_every {k} needs a gradient log of {k} x {grad_bytes / 2**20:.1f} MB per rank, "
                         f"but only {budget_bytes / 2**20:.0f} MB fit (half the available memory over this node's "
                         f"processes); use --protect-every {max(1, fit)} or less")
    return k
