"""Chunk transactions and tier-1 parity layout/decoding, checked in one process.

The k members' all-reduces are done in-process so that the protocol
(deltas, undo window, decode at the parity's version) is tested without processes.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.protect.chunks import ChunkedState
from unbroken.protect.tier1 import CorruptParity, ParityLayout, Tier1
from unbroken.protect.txn import StepScalars, TxnLog, UnrecoverableChunk


@settings(max_examples=30, deadline=None)
@given(k=st.integers(2, 6), windows=st.integers(1, 4))
def test_layout_rotates_parity_and_covers_every_chunk_once(k, windows):
    lay = ParityLayout(k, windows * (k - 1))
    for j in range(k):
        seen = sorted(lay.chunk(j, w, s) for w in range(lay.n_windows) for s in lay.holders(j))
        assert seen == list(range(lay.n_chunks))
    # each member holds one parity chunk per window: overhead 1/(k-1) of its data
    assert lay.n_windows * (k - 1) == lay.n_chunks


def test_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="multiple of k-1"):
        ParityLayout(4, 4)
    with pytest.raises(ValueError, match="at least 2"):
        ParityLayout(1, 3)


def test_txn_versions_come_from_current_or_snapshot():
    log = TxnLog(n_chunks=3, n_parity=1)
    log.begin(StepScalars(step=1, clip_coef=1.0))
    log.commit_chunk(0, 1)
    assert log.source(0, 1) == "current" and log.source(0, 0) == "snapshot"
    assert log.source(1, 0) == "current"  # not yet updated: current and snapshot agree
    with pytest.raises(UnrecoverableChunk, match="not reachable"):
        log.source(0, 2)
    log.commit_chunk(1, 1)
    log.commit_chunk(2, 1)
    log.begin(StepScalars(step=2, clip_coef=0.5))
    log.commit_chunk(0, 2)
    with pytest.raises(UnrecoverableChunk):
        log.source(0, 1)  # neither current (2) nor the snapshot (0)
    assert log.scalars_for(2).clip_coef == 0.5
    for c in (1, 2):
        log.commit_chunk(c, 2)
    log.snapshot_taken(2)
    assert log.snap_ver == 2 and log.history == {}
    with pytest.raises(UnrecoverableChunk, match="no scalars"):
        log.scalars_for(1)


class _Member:
    def __init__(self, j: int, k: int, n_chunks: int, elems: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed * 100 + j)
        self.tensors = [torch.randn(n_chunks * elems, generator=g) for _ in range(3)]
        self.state = ChunkedState(self.tensors, elems, trailer_words=k)
        self.snap = ChunkedState([torch.zeros_like(t) for t in self.tensors], elems, trailer_words=k)
        self.txn = TxnLog(n_chunks, n_chunks // (k - 1))
        self.t1 = Tier1(self.state, ParityLayout(k, n_chunks), j, self.txn, self.snap)


def _xor_allreduce(bufs):
    """What an all-reduce with ReduceOp.BXOR leaves in every member's buffer."""
    acc = torch.zeros_like(bufs[0])
    for b in bufs:
        acc ^= b
    for b in bufs:
        b.copy_(acc)


def _build(members, windows, k):
    """The parity build's layout (Tier1.build), with the all-reduce done in-process."""
    for m in members:
        m.t1.crcs = [m.state.crc(c) for c in range(m.state.n_chunks)]
    for w in range(windows):
        bufs = []
        for j, m in enumerate(members):
            buf = torch.zeros((k, *m.state.chunk_shape), dtype=torch.int32)
            for s in m.t1.layout.holders(j):
                c = m.t1.layout.chunk(j, w, s)
                m.state.pack(c, buf[s])
                buf[s][m.state.data_words + j] = m.t1.crcs[c]
            bufs.append(buf)
        _xor_allreduce(bufs)
        for j, m in enumerate(members):
            m.t1.parity[w].copy_(bufs[j][j])
    for m in members:
        m.txn.parity_ver[:] = 0
        m.snap.copy_from(m.state)
        m.txn.snapshot_taken(0)


def _decode(members, lost, pv):
    contrib = [m.t1.decode_contribution(lost, pv) for j, m in enumerate(members) if j != lost]
    acc = torch.zeros_like(contrib[0])
    for c in contrib:
        acc ^= c
    return acc


@settings(max_examples=12, deadline=None)
@given(k=st.sampled_from([2, 3, 4]), windows=st.integers(1, 3), lost=st.integers(0, 3), seed=st.integers(0, 99))
def test_parity_build_delta_and_decode_bitwise(k, windows, lost, seed):
    lost %= k
    n_chunks, elems = windows * (k - 1), 8
    members = [_Member(j, k, n_chunks, elems, seed) for j in range(k)]
    _build(members, windows, k)
    original = [t.clone() for t in members[lost].tensors]
    # one step changes every chunk; only window 0's deltas are staged and absorbed (a parity
    # step cut short after window 0), so rows of window 1+ still hold the snapshot's version
    for j, m in enumerate(members):
        m.txn.begin(StepScalars(step=1, clip_coef=1.0))
        for c in range(n_chunks):
            for t in m.tensors:
                t[c * elems:(c + 1) * elems] += 1.0 + c
            m.txn.commit_chunk(c, 1)
        for s, c in zip(m.t1.layout.holders(j), m.t1.layout.window_chunks(j, 0)):
            m.t1.stage_delta(0, s, c)
    # window 0's all-to-all, done in-process: member j's outgoing slot s lands in holder s's
    # incoming slot j; then every holder absorbs what it received
    for j, m in enumerate(members):
        for s in m.t1.layout.holders(j):
            members[s].t1._incoming[0][j].copy_(m.t1._windows[0][s])
    for m in members:
        m.t1.absorb(0, 1)
    w0 = set(members[lost].t1.layout.window_chunks(lost, 0))
    expected = [t.clone() for t in members[lost].tensors]
    for c in range(n_chunks):  # chunks outside window 0 are decoded at the snapshot's version
        if c not in w0:
            for e, o in zip(expected, original):
                e[c * elems:(c + 1) * elems] = o[c * elems:(c + 1) * elems]
    pv = [m.txn.parity_ver.tolist() for m in members]
    decoded = _decode(members, lost, pv)
    fresh = _Member(lost, k, n_chunks, elems, seed + 1)  # a new process: different garbage
    fresh.t1.install_decoded(decoded, pv)
    for got, want in zip(fresh.tensors, expected):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for got, want in zip(fresh.snap.tensors, expected):  # the snapshot too: the decode yields it
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert sorted(int(fresh.txn.chunk_ver[c]) for c in w0) == [1] * len(w0)
    assert not torch.equal(expected[0], original[0])


def test_corrupted_parity_fails_the_checksum():
    k, n_chunks, elems = 3, 2, 8
    members = [_Member(j, k, n_chunks, elems, 1) for j in range(k)]
    _build(members, 1, k)
    members[1].t1.parity[0][3] ^= 1 << 7
    pv = [m.txn.parity_ver.tolist() for m in members]
    decoded = _decode(members, 0, pv)
    with pytest.raises(CorruptParity, match="fails its checksum"):
        _Member(0, k, n_chunks, elems, 5).t1.install_decoded(decoded, pv)
