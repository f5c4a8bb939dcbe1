"""Tier 1: XOR parity of sharded state held in peers' memory, rotated RAID-5 style.

A parity group has k members, each with C chunks (C a multiple of k-1). Window w
spans rows w*k .. w*k+k-1; row w*k+s has its parity on member s and one data chunk
from every other member. So each member stores C/(k-1) parity chunks: memory
overhead 1/(k-1), no member holds more than its share. One reduce-scatter with
ReduceOp.BXOR all-reduce over a window's k slots delivers every row's parity (or
parity delta) to its holder at once (gloo's all-reduce is ~2x faster here than its
reduce-scatter, which moves less data but is poorly optimized). Windows are pipelined:
up to PIPELINE collectives are in flight while the next window is being updated.

Every packed chunk carries a trailer of k int32 words; member i writes the CRC-32 of its
chunk into word i. XOR keeps distinct words apart, so each parity chunk also holds the
checksum of every member's chunk in its row, and a decoded chunk is verified against
it before it is trusted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from unbroken.protect.chunks import ChunkedState
from unbroken.protect.txn import TxnLog
import torch.distributed as dist

from unbroken.comm.group import Comm, Pending

_BUILD_BATCH_WINDOWS = 8
PIPELINE = 2  # window collectives in flight at once during an update


class CorruptParity(RuntimeError):
    """A decoded chunk does not match the checksum its parity carries."""
  # windows per collective in a full build: bounds transient memory


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
        # Rotating per-window buffers: k slots (slot s = the delta for holder s).
        self._windows = torch.zeros((PIPELINE + 1, layout.k, *shape), dtype=torch.int32)
        self.bytes_protected = state.n_chunks * state.chunk_bytes
        assert state.trailer_words >= layout.k, "ChunkedState needs a trailer of k words for checksums"
        self.crcs = [0] * state.n_chunks  # CRC-32 of our chunks as the parity knows them

    @property
    def parity_bytes(self) -> int:
        return self.parity.numel() * 4

    def _crc_word(self) -> int:
        return self.state.data_words + self.member

    # --- full build ----------------------------------------------------------------
    def build(self, comm: Comm, step: int) -> float:
        """(Re)compute every parity chunk from current data; returns seconds taken."""
        t0 = time.perf_counter()
        lay, j = self.layout, self.member
        for w0 in range(0, lay.n_windows, _BUILD_BATCH_WINDOWS):
            ws = range(w0, min(w0 + _BUILD_BATCH_WINDOWS, lay.n_windows))
            buf = torch.zeros((len(ws), lay.k, *self.state.chunk_shape), dtype=torch.int32)
            for s in lay.holders(j):
                for i, w in enumerate(ws):
                    c = lay.chunk(j, w, s)
                    self.state.pack(c, buf[i, s])
                    self.crcs[c] = self.state.crc(c)
                    buf[i, s, self._crc_word()] = self.crcs[c]
            comm.allreduce(buf, op=dist.ReduceOp.BXOR, what=f"parity build windows {w0}+")
            self.parity[w0:w0 + len(ws)].copy_(buf[:, j])
        self.txn.parity_ver[:] = step
        return time.perf_counter() - t0

    # --- per-step deltas -----------------------------------------------------------
    def stage_delta(self, w: int, holder: int, c: int, old: torch.Tensor) -> None:
        """Chunk c (row (w, holder)) was just updated from `old`: stage old XOR new, checksums too."""
        d, dw = self._windows[w % (PIPELINE + 1), holder], self.state.data_words
        self.state.pack(c, d)
        d[:dw].bitwise_xor_(old[:dw])
        d[dw:].zero_()
        new = self.state.crc(c)
        d[self._crc_word()] = self.crcs[c] ^ new
        self.crcs[c] = new

    def start_window(self, comm: Comm, w: int) -> Pending:
        """Issue window w's all-reduce of staged deltas (our own slot carries nothing)."""
        buf = self._windows[w % (PIPELINE + 1)]
        buf[self.member].zero_()
        return comm.allreduce_start(buf, op=dist.ReduceOp.BXOR, what=f"parity delta window {w}")

    def finish_window(self, comm: Comm, pending: Pending, w: int, step: int) -> None:
        """Wait for window w's all-reduce; XOR our row's delta into our parity chunk."""
        comm.finish(pending)
        self.parity[w].bitwise_xor_(self._windows[w % (PIPELINE + 1), self.member])
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
        """On the new member: verify each decoded chunk's CRC, then write it and its version."""
        lay, j, dw = self.layout, self.member, self.state.data_words
        for w in range(lay.n_windows):
            for idx, s in enumerate(lay.holders(j)):
                got = ChunkedState.crc_of_packed(decoded[w, idx], dw)
                want = int(decoded[w, idx][dw + j])
                if got != want:
                    raise CorruptParity(f"decoded chunk for window {w} (parity holder: group member {s}) fails its "
                                        f"checksum (crc {got:#x}, parity says {want:#x}): a parity or data chunk "
                                        "is corrupted; falling back to tier 2")
        for w in range(lay.n_windows):
            for idx, s in enumerate(lay.holders(j)):
                c = lay.chunk(j, w, s)
                self.state.unpack(c, decoded[w, idx])
                self.txn.chunk_ver[c] = int(parity_versions[s][w])
