"""Tier 1: XOR parity of sharded state held in peers' memory, rotated RAID-5 style.

A parity group has k members, each with C chunks (C a multiple of k-1). Window w
spans rows w*k .. w*k+k-1; row w*k+s has its parity on member s and one data chunk
from every other member. So each member stores C/(k-1) parity chunks: memory
overhead 1/(k-1), no member holds more than its share. The full build is one XOR
all-reduce per batch of windows (gloo's BXOR, or the exchange path where there is none). Per-step deltas travel by one gloo all-to-all per
window: member j sends its delta for row (w, s) straight to holder s and receives the
k-1 deltas for its own row, so each rank moves exactly its protected bytes per step
(a BXOR all-reduce moved ~2k/(k-1) times that, and took twice as long here). Windows are
pipelined: up to PIPELINE exchanges are in flight while the next window is updated.
Deltas are taken against the snapshot of the previous parity point, so parity may be
brought up to date every K steps instead of every step (`protect_every`).

Every packed chunk carries a trailer of k int32 words; member i writes the CRC-32C of its
chunk into word i. XOR keeps distinct words apart, so each parity chunk also holds the
checksum of every member's chunk in its row, and a decoded chunk is verified against
it before it is trusted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from unbroken.comm.group import Comm, Pending
from unbroken.protect.chunks import ChunkedState
from unbroken.protect.txn import TxnLog

_BUILD_BATCH_WINDOWS = 8  # windows per collective in a full build: bounds transient memory
PIPELINE = 2  # window collectives in flight at once during an update


class CorruptParity(RuntimeError):
    """A decoded chunk does not match the checksum its parity carries."""


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

    def __init__(self, state: ChunkedState, layout: ParityLayout, member: int, txn: TxnLog,
                 snap: ChunkedState) -> None:
        assert layout.n_chunks == state.n_chunks == snap.n_chunks
        self.state, self.layout, self.member, self.txn = state, layout, member, txn
        self.snap = snap  # the state as of the last parity point (txn.snap_ver): what parity encodes
        shape = state.chunk_shape
        dev = state.device
        self.parity = torch.zeros((layout.n_windows, *shape), dtype=torch.int32, device=dev)
        # Rotating per-window buffers of k slots: outgoing slot s = our delta for holder s,
        # incoming slot m = member m's delta for our row (our own slot of each stays unused).
        self._windows = torch.zeros((PIPELINE + 1, layout.k, *shape), dtype=torch.int32, device=dev)
        self._incoming = torch.zeros((PIPELINE + 1, layout.k, *shape), dtype=torch.int32, device=dev)
        self.bytes_protected = state.n_chunks * state.chunk_bytes
        assert state.trailer_words >= layout.k, "ChunkedState needs a trailer of k words for checksums"
        self.crcs = [0] * state.n_chunks  # CRC-32C of our chunks as the parity knows them

    @property
    def parity_bytes(self) -> int:
        return self.parity.numel() * 4

    @property
    def pipeline_bytes(self) -> int:
        """The rotating outgoing/incoming delta windows of the parity update pipeline."""
        return (self._windows.numel() + self._incoming.numel()) * 4

    def _crc_word(self) -> int:
        return self.state.data_words + self.member

    # --- full build ----------------------------------------------------------------
    def build(self, comm: Comm, step: int) -> float:
        """(Re)compute every parity chunk from current data (all at `step`, as the snapshot
        must be too); returns seconds taken."""
        t0 = time.perf_counter()
        lay, j = self.layout, self.member
        for w0 in range(0, lay.n_windows, _BUILD_BATCH_WINDOWS):
            ws = range(w0, min(w0 + _BUILD_BATCH_WINDOWS, lay.n_windows))
            buf = torch.zeros((len(ws), lay.k, *self.state.chunk_shape), dtype=torch.int32, device=self.state.device)
            for s in lay.holders(j):
                for i, w in enumerate(ws):
                    c = lay.chunk(j, w, s)
                    self.crcs[c] = self.state.crc(c)
                    self._pack_with_crc(c, buf[i, s])
            comm.xor_allreduce(buf, what=f"parity build windows {w0}+")
            self.parity[w0:w0 + len(ws)].copy_(buf[:, j])
        self.txn.parity_ver[:] = step
        return time.perf_counter() - t0

    # --- per-step deltas -----------------------------------------------------------
    def stage_delta(self, w: int, holder: int, c: int) -> None:
        """Chunk c (row (w, holder)) is at the new parity point: stage snapshot XOR current, checksums too."""
        d, dw = self._windows[w % (PIPELINE + 1), holder], self.state.data_words
        self.state.xor_with(c, self.snap, d)
        d[dw:].zero_()
        new = self.state.crc(c)
        d[self._crc_word()] = self.crcs[c] ^ new
        self.crcs[c] = new

    def start_window(self, comm: Comm, w: int) -> Pending:
        """Send window w's staged deltas to their holders and receive the deltas for our row."""
        slot = w % (PIPELINE + 1)
        return comm.alltoall_start(self._incoming[slot], self._windows[slot], what=f"parity delta window {w}")

    def finish_window(self, comm: Comm, pending: Pending, w: int, step: int) -> None:
        """Wait for window w's exchange; XOR the deltas received into our parity chunk."""
        comm.finish(pending)
        self.absorb(w, step)

    def absorb(self, w: int, step: int) -> None:
        inc = self._incoming[w % (PIPELINE + 1)]
        for m in self.layout.holders(self.member):
            self.parity[w].bitwise_xor_(inc[m])
        self.txn.parity_absorbed(w, step)

    # --- recovery ------------------------------------------------------------------
    def decode_contribution(self, lost: int, parity_versions: list[list[int]],
                            out: torch.Tensor | None = None) -> torch.Tensor:
        """This survivor's XOR share of the lost member's chunks, each at its row's parity version.

        parity_versions[s][w] is holder s's parity version for window w; out, if given, is a
        (n_windows, k-1, *chunk_shape) buffer to fill.
        """
        lay, j = self.layout, self.member
        if out is None:
            out = torch.zeros((lay.n_windows, lay.k - 1, *self.state.chunk_shape), dtype=torch.int32,
                              device=self.state.device)
        for w in range(lay.n_windows):
            for idx, s in enumerate(lay.holders(lost)):
                if s == j:
                    out[w, idx].copy_(self.parity[w])
                else:
                    self.pack_at(lay.chunk(j, w, s), int(parity_versions[s][w]), out[w, idx])
        return out

    def pack_at(self, c: int, version: int, out: torch.Tensor) -> torch.Tensor:
        """Chunk c's data words at `version` (current or snapshot) into out; trailer zeroed.
        Raises UnrecoverableChunk."""
        src = self.state if self.txn.source(c, version) == "current" else self.snap
        src.pack(c, out)
        out[self.state.data_words:].zero_()
        return out

    def row_contribution(self, holder: int, version: int, out: torch.Tensor) -> torch.Tensor:
        """Our chunk of every row (w, holder) at `version` (the snapshot's, which our checksums
        describe), with our checksum word: XORed over the group's other members this is
        holder's parity. out: (n_windows, *chunk_shape)."""
        lay, j = self.layout, self.member
        for w in range(lay.n_windows):
            c = lay.chunk(j, w, holder)
            self.pack_at(c, version, out[w])
            out[w][self._crc_word()] = self.crcs[c]
        return out

    def _pack_with_crc(self, c: int, out: torch.Tensor) -> None:
        """Chunk c's data, then a trailer holding only our checksum word (XOR keeps members apart)."""
        self.state.pack(c, out)
        out[self.state.data_words:].zero_()
        out[self._crc_word()] = self.crcs[c]

    def install_parity(self, parity: torch.Tensor, step: int) -> None:
        """On a new member: its parity rows, rebuilt by XOR of the others' row_contribution()."""
        self.parity.copy_(parity)
        self.txn.parity_ver[:] = step

    def install_decoded(self, decoded: torch.Tensor, parity_versions: list[list[int]]) -> None:
        """On the new member: verify each decoded chunk's CRC, then write it and its version (into
        the current state and the snapshot: the decode yields the parity point's bytes)."""
        lay, j, dw = self.layout, self.member, self.state.data_words
        for w in range(lay.n_windows):
            for idx, s in enumerate(lay.holders(j)):
                got = ChunkedState.crc_of_packed(decoded[w, idx], dw)
                want = int(decoded[w, idx][dw + j])
                self.crcs[lay.chunk(j, w, s)] = got
                if got != want:
                    raise CorruptParity(f"decoded chunk for window {w} (parity holder: group member {s}) fails its "
                                        f"checksum (crc {got:#x}, parity says {want:#x}): a parity or data chunk "
                                        "is corrupted; falling back to tier 2")
        for w in range(lay.n_windows):
            for idx, s in enumerate(lay.holders(j)):
                c = lay.chunk(j, w, s)
                self.state.unpack(c, decoded[w, idx])
                self.snap.unpack(c, decoded[w, idx])
                self.txn.chunk_ver[c] = int(parity_versions[s][w])
