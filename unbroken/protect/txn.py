"""Chunk-level transactions: per-chunk versions, a bounded undo window, parity versions.

Version v of a chunk = the chunk after v optimizer steps. During step t a chunk moves
t-1 -> t exactly once. Its old bytes are kept in an undo slot until every parity holder
has absorbed its delta (known when the *next* collective of the same group completes),
so that at any crash instant each chunk can be produced at the version its parity
reflects. The pool of undo slots is fixed (a few chunks), never a second state copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class UnrecoverableChunk(RuntimeError):
    """A chunk is needed at a version this rank can no longer produce."""


@dataclass(frozen=True)
class StepScalars:
    """Global values of one optimizer step, fixed (and recorded) before any chunk changes."""

    step: int
    lr: float
    clip_coef: float


class TxnLog:
    def __init__(self, n_chunks: int, n_parity: int, chunk_shape: tuple[int, int], undo_slots: int) -> None:
        assert undo_slots >= 1
        self.chunk_ver = np.zeros(n_chunks, dtype=np.int64)
        self.parity_ver = np.full(n_parity, -1, dtype=np.int64)  # -1: parity not built yet
        self._pool = torch.zeros((undo_slots, *chunk_shape), dtype=torch.int32)
        self._free = list(range(undo_slots))
        self._undo: dict[int, int] = {}  # chunk -> slot holding its bytes at chunk_ver-1
        self.scalars: StepScalars | None = None

    # --- the step's lifecycle ----------------------------------------------------------
    def begin(self, scalars: StepScalars) -> None:
        t = scalars.step
        assert (self.chunk_ver >= t - 1).all() and (self.chunk_ver <= t).all(), \
            f"step {t} begun with chunks at versions {set(self.chunk_ver.tolist())}"
        self.scalars = scalars

    def undo_buffer(self, c: int) -> torch.Tensor:
        """A slot to copy chunk c's old bytes into before changing it."""
        if not self._free:
            raise RuntimeError(f"undo window full ({len(self._pool)} slots) while staging chunk {c}; "
                               "release a window after its parity collective completes")
        slot = self._free.pop()
        self._undo[c] = slot
        return self._pool[slot]

    def commit_chunk(self, c: int, step: int) -> None:
        assert self.chunk_ver[c] == step - 1, f"chunk {c} at version {self.chunk_ver[c]}, expected {step - 1}"
        self.chunk_ver[c] = step

    def parity_absorbed(self, p: int, step: int) -> None:
        self.parity_ver[p] = step

    def release(self, chunks) -> None:
        for c in chunks:
            slot = self._undo.pop(int(c), None)
            if slot is not None:
                self._free.append(slot)

    def release_all(self) -> None:
        self.release(list(self._undo))

    # --- recovery -----------------------------------------------------------------------
    def chunk_at(self, c: int, version: int, current: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Chunk c's bytes at `version`, from its current bytes or its undo slot."""
        v = int(self.chunk_ver[c])
        if version == v:
            out.copy_(current)
        elif version == v - 1 and c in self._undo:
            out.copy_(self._pool[self._undo[c]])
        else:
            raise UnrecoverableChunk(f"chunk {c} is at version {v}; version {version} was asked and "
                                     f"{'its undo bytes are gone' if version == v - 1 else 'is not reachable'}")
        return out
