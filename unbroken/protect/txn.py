"""Chunk-level transactions: per-chunk versions, parity versions, the snapshot and the step log.

Version v of a chunk = the chunk after v optimizer steps. During step t a chunk moves
t-1 -> t exactly once. Tier-1 parity reflects the snapshot taken at the last parity
point P (`snap_ver`); between parity points chunks move on while the parity stays at P.
At any crash instant each chunk can be produced at every version a parity row may hold:
its current bytes (version `chunk_ver[c]`) or the snapshot (version `snap_ver`), which is
replaced only after every holder has absorbed the next parity point's deltas. The step
log keeps each step's global scalars since P, so a chunk decoded at P can be replayed
forward exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class UnrecoverableChunk(RuntimeError):
    """A chunk is needed at a version this rank can no longer produce."""


@dataclass(frozen=True)
class StepScalars:
    """Global values of one optimizer step, fixed (and recorded) before any chunk changes: the
    clip coefficient, whether the step is skipped, and every param group's hyperparameters."""

    step: int
    clip_coef: float = 1.0
    skip: bool = False  # a step skipped for a non-finite gradient: every chunk keeps its bytes
    groups: tuple = ()  # per param group: {"lr": ..., ...} as the optimizer's groups held them

    @property
    def lr(self) -> float:
        return float(self.groups[0]["lr"]) if self.groups else 0.0

    def to_list(self) -> list:
        return [self.step, self.clip_coef, self.skip, [dict(g) for g in self.groups]]

    @staticmethod
    def from_list(x: list) -> "StepScalars":
        return StepScalars(step=int(x[0]), clip_coef=float(x[1]), skip=bool(x[2]), groups=tuple(dict(g) for g in x[3]))


class TxnLog:
    def __init__(self, n_chunks: int, n_parity: int) -> None:
        self.chunk_ver = np.zeros(n_chunks, dtype=np.int64)
        self.parity_ver = np.full(n_parity, -1, dtype=np.int64)  # -1: parity not built yet
        self.snap_ver = 0  # the version every chunk of the snapshot holds
        self.history: dict[int, StepScalars] = {}  # scalars of every step after snap_ver

    # --- the step's lifecycle ----------------------------------------------------------
    def begin(self, scalars: StepScalars) -> None:
        t = scalars.step
        assert (self.chunk_ver >= t - 1).all() and (self.chunk_ver <= t).all(), \
            f"step {t} begun with chunks at versions {set(self.chunk_ver.tolist())}"
        self.record(scalars)

    def record(self, scalars: StepScalars) -> None:
        self.history[scalars.step] = scalars

    def commit_chunk(self, c: int, step: int) -> None:
        assert self.chunk_ver[c] == step - 1, f"chunk {c} at version {self.chunk_ver[c]}, expected {step - 1}"
        self.chunk_ver[c] = step

    def parity_absorbed(self, p: int, step: int) -> None:
        self.parity_ver[p] = step

    def snapshot_taken(self, step: int) -> None:
        """The snapshot now holds version `step` of every chunk; older scalars are not needed."""
        assert (self.chunk_ver == step).all(), f"snapshot at {step} with chunks at {set(self.chunk_ver.tolist())}"
        self.snap_ver = step
        self.history = {s: v for s, v in self.history.items() if s > step}

    # --- recovery -----------------------------------------------------------------------
    def source(self, c: int, version: int) -> str:
        """Where chunk c's bytes at `version` are: "current" or "snapshot"."""
        v = int(self.chunk_ver[c])
        if version == v:
            return "current"
        if version == self.snap_ver:
            return "snapshot"
        raise UnrecoverableChunk(f"chunk {c} is at version {v} and the snapshot at {self.snap_ver}; "
                                 f"version {version} was asked and is not reachable")

    def scalars_for(self, step: int) -> StepScalars:
        if step not in self.history:
            raise UnrecoverableChunk(f"no scalars recorded for step {step} (have {sorted(self.history)})")
        return self.history[step]
