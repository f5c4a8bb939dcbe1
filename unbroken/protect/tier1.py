"""Tier 1: XOR parity of sharded state held in peers' memory, rotated RAID-5 style.

A parity group has k members, each with C chunks (C a multiple of k-1). Window w
spans rows w*k .. w*k+k-1; row w*k+s has its parity on member s and one data chunk
from every other member. So each member stores C/(k-1) parity chunks: memory
overhead 1/(k-1), no member holds more than its share. One reduce-scatter with
ReduceOp.BXOR over a window delivers every row's parity (or parity delta) to its
holder at once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from unbroken.protect.chunks import ChunkedState
from unbroken.protect.txn import TxnLog
from unbroken.comm.group import Comm

_BUILD_BATCH_WINDOWS = 8  # windows per collective in a full build: bounds transient memory


@dataclass(frozen=True)
class ParityLayout:
    k: int          # group size
    n_chunks: int   # data chunks per member

    def __post_init__(self) -> None:
        if self.k < 2:
            raise ValueError(f"a parity group needs at least 2 members, got {self.k}")
        if self.n_chunks % (self.k - 1):
            raise ValueError(f"chunks per member ({self.n_chunks}) must be a multiple of k-1 ({self.k - 1})")

    @property
    def n_windows(self) -> int:
        return self.n_chunks // (self.k - 1)

    def chunk(self, member: int, w: int, holder: int) -> int:
        """The chunk of `member` that lies in row (w, holder); holder != member."""
        assert holder != member
        return w * (self.k - 1) + (holder if holder < member else holder - 1)

    def holders(self, member: int) -> list[int]:
        return [s for s in range(self.k) if s != member]

    def window_chunks(self, member: int, w: int) -> list[int]:
        return [self.chunk(member, w, s) for s in self.holders(member)]


class Tier1:
    """One member's parity chunks and the collectives that keep them current."""

    def __init__(self, state: ChunkedState, layout: ParityLayout, member: int, txn: TxnLog) -> None:
        assert layout.n_chunks == state.n_chunks
        self.state, self.layout, self.member, self.txn = state, layout, member, txn
        shape = state.chunk_shape
        self.parity = torch.zeros((layout.n_windows, *shape), dtype=torch.int32)
        self._deltas = torch.zeros((layout.k, *shape), dtype=torch.int32)   # one window's inputs
        self._received = torch.zeros(shape, dtype=torch.int32)
        self.bytes_protected = state.n_chunks * state.chunk_bytes

    @property
    def parity_bytes(self) -> int:
        return self.parity.numel() * 4

    # --- full build ----------------------------------------------------------------
    def build(self, comm: Comm, step: int) -> float:
        """(Re)compute every parity chunk from current data; returns seconds taken."""
        t0 = time.perf_counter()
        lay, j = self.layout, self.member
        for w0 in range(0, lay.n_windows, _BUILD_BATCH_WINDOWS):
            ws = range(w0, min(w0 + _BUILD_BATCH_WINDOWS, lay.n_windows))
            inputs = [torch.zeros((len(ws), *self.state.chunk_shape), dtype=torch.int32) for _ in range(lay.k)]
            for s in lay.holders(j):
                for i, w in enumerate(ws):
                    self.state.pack(lay.chunk(j, w, s), inputs[s][i])
            comm.reduce_scatter_xor(self.parity[w0:w0 + len(ws)], inputs, what=f"parity build windows {w0}+")
        self.txn.parity_ver[:] = step
        return time.perf_counter() - t0

    # --- per-step deltas -----------------------------------------------------------
    def delta_slot(self, holder: int) -> torch.Tensor:
        """Where the update writes (old XOR new) of its chunk for row (w, holder)."""
        return self._deltas[holder]

    def absorb_window(self, comm: Comm, w: int, step: int) -> None:
        """Send this window's deltas to their holders; XOR what we receive into our parity."""
        self._deltas[self.member].zero_()
        comm.reduce_scatter_xor(self._received, list(self._deltas), what=f"parity delta window {w}")
        self.parity[w].bitwise_xor_(self._received)
        self.txn.parity_absorbed(w, step)

    # --- recovery ------------------------------------------------------------------
    def decode_contribution(self, lost: int, parity_versions: list[list[int]]) -> torch.Tensor:
        """This survivor's XOR share of the lost member's chunks, each at its row's parity version.

        parity_versions[s][w] is holder s's parity version for window w.
        """
        lay, j = self.layout, self.member
        out = torch.zeros((lay.n_windows, lay.k - 1, *self.state.chunk_shape), dtype=torch.int32)
        cur = self.state.empty_chunk()
        for w in range(lay.n_windows):
            for idx, s in enumerate(lay.holders(lost)):
                if s == j:
                    out[w, idx].copy_(self.parity[w])
                else:
                    c = lay.chunk(j, w, s)
                    self.txn.chunk_at(c, int(parity_versions[s][w]), self.state.pack(c, cur), out[w, idx])
        return out

    def install_decoded(self, decoded: torch.Tensor, parity_versions: list[list[int]]) -> None:
        """On the new member: write decoded chunks into state and record their versions."""
        lay, j = self.layout, self.member
        for w in range(lay.n_windows):
            for idx, s in enumerate(lay.holders(j)):
                c = lay.chunk(j, w, s)
                self.state.unpack(c, decoded[w, idx])
                self.txn.chunk_ver[c] = int(parity_versions[s][w])
