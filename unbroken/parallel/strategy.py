"""The optimizer state a rank owns and the chunked, transactional update of it.

`zero1`: rank r owns shard r of the flat parameters and its Adam moments, updates it
chunk by chunk, sends each window's parity deltas to their holders (one all-to-all), then all ranks
all-gather the parameters. `ddp`: every rank owns everything (replicated); no parity
is needed because any survivor is a copy.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from unbroken.comm.group import Comm
from unbroken.parallel.adamw import AdamW
from unbroken.parallel.flat import FlatModel
from unbroken.protect.chunks import ChunkedState
from unbroken.protect.tier1 import PIPELINE, ParityLayout, Tier1
from unbroken.protect.txn import StepScalars, TxnLog

Point = Callable[[str, int], None]  # fault-injection hook: point(phase, chunk)


class OwnedState:
    def __init__(self, model: nn.Module, *, strategy: str, rank: int, world: int, group_size: int,
                 chunk_elems: int, optim: AdamW) -> None:
        self.strategy, self.rank, self.world, self.optim = strategy, rank, world, optim
        sharded = strategy == "zero1"
        self.k = group_size if (sharded and group_size >= 2) else 1
        self.flat = FlatModel(model, world=world if sharded else 1, chunk_elems=chunk_elems,
                              multiple=max(1, self.k - 1))
        self.lo, self.hi = self.flat.shard_range(rank if sharded else 0)
        n = self.hi - self.lo
        self.m, self.v = torch.zeros(n), torch.zeros(n)
        self.state = ChunkedState([self.flat.params[self.lo:self.hi], self.m, self.v], self.flat.chunk_elems,
                                  trailer_words=self.k if self.k >= 2 else 0)
        self.layout = ParityLayout(self.k, self.state.n_chunks) if self.k >= 2 else None
        self.member = rank % self.k
        n_parity = self.layout.n_windows if self.layout else 0
        # a window's undo lives until the exchange PIPELINE windows later completes (see
        # _finish_oldest): at most 2*PIPELINE windows of k-1 chunks are held at once
        self.txn = TxnLog(self.state.n_chunks, n_parity, self.state.chunk_shape,
                          undo_slots=2 * PIPELINE * max(1, self.k - 1))
        self.tier1 = Tier1(self.state, self.layout, self.member, self.txn) if self.layout else None
        self._shard_copy = torch.zeros(n) if sharded else None

    @property
    def sharded(self) -> bool:
        return self.strategy == "zero1"

    # --- one chunk ---------------------------------------------------------------------
    def apply_chunk(self, c: int, s: StepScalars, point: Point | None = None) -> None:
        e = self.state.chunk_elems
        a, b = c * e, (c + 1) * e
        p = self.flat.params[self.lo + a:self.lo + b]
        g = self.flat.grads[self.lo + a:self.lo + b]
        self.optim.apply(p, g, self.m[a:b], self.v[a:b], s, point=(lambda: point("midchunk", c)) if point else None)
        self.txn.commit_chunk(c, s.step)

    # --- the step's update ---------------------------------------------------------------
    def update(self, s: StepScalars, group: Comm | None, point: Point) -> None:
        self.txn.begin(s)
        if self.tier1 is None:
            for c in range(self.state.n_chunks):
                point("optimizer", c)
                self.apply_chunk(c, s, point)
            return
        lay, inflight, undo = self.layout, [], {}
        for w in range(lay.n_windows):
            if len(inflight) == PIPELINE:
                self._finish_oldest(group, inflight, undo, s.step)
            chunks = lay.window_chunks(self.member, w)
            for holder, c in zip(lay.holders(self.member), chunks):
                point("optimizer", c)
                old = self.state.pack(c, self.txn.undo_buffer(c))
                self.apply_chunk(c, s, point)
                self.tier1.stage_delta(w, holder, c, old)
            undo[w] = chunks
            point("parity", w)
            inflight.append((w, self.tier1.start_window(group, w)))
        while inflight:
            self._finish_oldest(group, inflight, undo, s.step)

    def _finish_oldest(self, group: Comm, inflight: list, undo: dict, step: int) -> None:
        w, pending = inflight.pop(0)
        self.tier1.finish_window(group, pending, w, step)
        # Every rank issues window w's collective only after it finished window w-PIPELINE's.
        # So w completing here means every holder has absorbed window w-PIPELINE: drop its undo.
        self.txn.release(undo.pop(w - PIPELINE, []))

    def commit(self, world: Comm) -> None:
        """Make the step visible everywhere: all-gather the updated parameter shards."""
        if self.sharded and self.world > 1:
            self._shard_copy.copy_(self.flat.params[self.lo:self.hi])
            world.allgather_into(self.flat.params, self._shard_copy, what="parameter all-gather")
        self.txn.release_all()  # the all-gather completing means the last window was absorbed everywhere

    def roll_forward(self, s: StepScalars) -> int:
        """Apply step s to every chunk still one version behind; returns how many."""
        behind = [c for c in range(self.state.n_chunks) if self.txn.chunk_ver[c] == s.step - 1]
        for c in behind:
            self.apply_chunk(c, s)
        return len(behind)

    # --- persistence -------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        return {"params": self.flat.params[self.lo:self.hi], "m": self.m, "v": self.v}

    def load(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        for name, t in self.tensors().items():
            src = tensors[name]
            if src.shape != t.shape or src.dtype != t.dtype:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)} {src.dtype}, "
                                 f"this job needs {tuple(t.shape)} {t.dtype}: was it written by another config?")
            t.copy_(src)
        self.txn.chunk_ver[:] = step
        self.txn.release_all()
