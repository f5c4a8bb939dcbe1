"""`IntervalTuner`: chooses protect_every when it is "auto", from this job's own measurements.

Until the first parity point the job runs with `DEFAULT_K`. Every step each rank puts its
measurements (median step time and update time of plain steps, the last parity step's
extra update time) into three spare slots of the gradient it all-reduces, so after the
all-reduce every rank holds the same averages, bit for bit. On the step after the first
parity point every rank computes K from them (`protect.interval.best_interval`, for the
configured expected failure interval, bounded by the ring allocated up front): all ranks
switch together without a message of their own.
"""
from __future__ import annotations

import statistics

import torch

from unbroken.config import ConfigError
from unbroken.protect.interval import DEFAULT_K, best_interval, memory_budget_bytes, ring_slots

N_AUX = 3  # (step_s, update_s, parity_extra_s)


class IntervalTuner:
    def __init__(self, *, mtbf_s: float, max_k: int) -> None:
        self.mtbf_s, self.max_k = mtbf_s, max_k
        self.plain: list[tuple[float, float]] = []  # (step_s, update_s) of steps without parity
        self.parity_update_s: float | None = None
        self.done = False

    @property
    def initial_k(self) -> int:
        return min(DEFAULT_K, self.max_k)

    def observe(self, step: int, step_s: float, update_s: float, parity: bool) -> None:
        if parity:
            self.parity_update_s = update_s
        elif step > 1:  # the first step pays for start-up
            self.plain.append((step_s, update_s))
            del self.plain[:-32]

    def fill(self, aux: torch.Tensor) -> None:
        """This rank's measurements into the gradient's spare slots (zeros until measured)."""
        if not self.plain or self.parity_update_s is None:
            aux.zero_()
            return
        step_s = statistics.median(s for s, _ in self.plain)
        update_s = statistics.median(u for _, u in self.plain)
        aux[0], aux[1], aux[2] = step_s, update_s, max(1e-4, self.parity_update_s - update_s)

    def choose(self, averaged: torch.Tensor) -> dict | None:
        """K from the all-reduced (averaged) measurements; None if some rank had none yet."""
        step_s, update_s, extra = (float(x) for x in averaged)
        if min(step_s, update_s, extra) <= 0:
            return None
        self.done = True
        k = best_interval(parity_s=extra, step_s=step_s, replay_step_s=update_s, mtbf_s=self.mtbf_s,
                          max_k=self.max_k)
        return {"protect_every": k, "parity_extra_s": round(extra, 5), "step_s": round(step_s, 5),
                "replay_step_s": round(update_s, 5), "mtbf_s": self.mtbf_s, "max_k": self.max_k}


def gradient_ring_slots(cfg, n_params: int) -> int:
    """Gradient buffers the ring needs (K, or the most "auto" may use); ConfigError naming the
    largest K that fits when the ring would not fit in memory."""
    if not cfg.tier1 or cfg.strategy != "zero1" or cfg.effective_parity_group < 2:
        return 1
    grad_bytes = 4 * (n_params + 4)
    try:
        return ring_slots(cfg.protect_every, grad_bytes, memory_budget_bytes(cfg.world_size + cfg.shadow_pool_max))
    except ValueError as e:
        raise ConfigError(str(e)) from None
