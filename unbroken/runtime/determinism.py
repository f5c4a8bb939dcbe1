"""Replayable randomness and the check that inputs really were replayed.

At the start of every step, and before every forward (first attempt or redo), unbroken
seeds Python's `random`, NumPy's global generator and torch's generators (CPU and CUDA)
from (seed, step, rank, purpose). A script that draws its batch or its dropout masks from
the global generators then draws the same values when a step is redone, or when a
replacement process computes the lost rank's step.

What seeding cannot make replayable (a stateful iterator the script reads, a file that
changed) is detected: each rank's loss of every step travels in the gradient all-reduce
(`FlatModel.rank_loss`), every rank keeps the recent steps' values, and a step computed
again with a different loss for some rank is a `nondeterministic_input` event and a
warning in the run's summary, never a silent divergence.
"""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

BATCH, FORWARD = 0, 1  # purposes: the loop body (batch drawing), the forward closure (+ micro-step)


def step_seed(seed: int, step: int, rank: int, purpose: int) -> int:
    """A 63-bit seed, a pure function of its arguments."""
    digest = hashlib.blake2b(f"{seed}/{step}/{rank}/{purpose}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_everything(seed: int, step: int, rank: int, purpose: int) -> None:
    s = step_seed(seed, step, rank, purpose)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)  # also seeds every CUDA device's generator


class InputFingerprints:
    """Each rank's loss of recent steps, as the all-reduce delivered them (exact: summed slots)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._seen: dict[int, torch.Tensor] = {}

    def observe(self, step: int, rank_losses: torch.Tensor) -> list[int]:
        """Record step's per-rank losses; the ranks whose loss differs from an earlier record of
        the same step (bitwise), [] if none or if the step was not seen before."""
        before = self._seen.get(step)
        if before is None:
            self._seen[step] = rank_losses.clone()
            while len(self._seen) > self.keep:
                del self._seen[min(self._seen)]
            return []
        same = before.view(torch.int32) == rank_losses.view(torch.int32)
        return [int(r) for r in torch.nonzero(~same).flatten()]

    def value(self, step: int) -> torch.Tensor | None:
        return self._seen.get(step)
