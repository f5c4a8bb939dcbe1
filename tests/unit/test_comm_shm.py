"""The shared-memory all-reduce (comm/shm.py) gives the reference reduction's bits and leaves no file."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.commgroups import on_ranks
from tests.unit.test_comm_patterns import DTYPES, _inputs
from unbroken.comm.group import CollectiveError
from unbroken.comm.patterns import reduce_rows
from unbroken.comm.shm import MIN_ROW_BYTES, SHM_DIR, ShmAllreduce, fit_rows


def _ours() -> set[str]:
    return {p.name for p in SHM_DIR.glob("unbroken-allreduce-*")}


def _allreduce(world: int, batches: list[list[torch.Tensor]], row_bytes: int) -> list:
    """Each batch all-reduced in turn by one ShmAllreduce per rank; every rank's results."""
    outs = [[x.clone() for x in b] for b in batches]

    def body(tp, r):
        shm = ShmAllreduce(tp.pg, rank=r, world=world, timeout_s=20.0, row_bytes=row_bytes)
        try:
            for b in outs:
                shm(b[r], what="test all-reduce")
        finally:
            shm.close()
        return [b[r] for b in outs]

    return on_ranks(world, body)


@settings(max_examples=25, deadline=None)
@given(world=st.integers(2, 8), n=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       rows=st.sampled_from([64, 128, 512, 1 << 16]), seed=st.integers(0, 2**16))
def test_results_equal_the_rank_order_reduction_in_pieces_and_in_both_regions(world, n, dtype, rows, seed):
    before = _ours()
    # three collectives: both regions and back (a row of 64 bytes cuts 300 float32 into 19 pieces)
    batches = [_inputs(world, n, dtype, seed + k) for k in range(3)]
    got = _allreduce(world, batches, rows)
    for k, xs in enumerate(batches):
        want = reduce_rows(xs)
        for r in range(world):
            assert torch.equal(got[r][k].view(torch.uint8), want.view(torch.uint8)), (k, r)  # the bits
    assert _ours() == before  # rank 0 unlinked the file once every rank had mapped it


class _Elsewhere(ShmAllreduce):
    """Rank 2 plays a rank on another host: rank 0's file is not there."""

    def _map_file(self, path, size, *, create):
        if self.rank == 2:
            raise FileNotFoundError(path)
        super()._map_file(path, size, create=create)


def test_a_rank_that_cannot_map_the_file_fails_setup_on_every_rank_with_the_fix():
    errors: list[str] = []
    before = _ours()

    def body(tp, r):
        shm = _Elsewhere(tp.pg, rank=r, world=3, timeout_s=10.0, row_bytes=64)
        try:
            shm(torch.ones(10))
        except CollectiveError as e:
            errors.append(str(e))
        return None

    on_ranks(3, body)
    assert len(errors) == 3 and all("needs every rank on one host" in e and "--collectives gloo" in e for e in errors)
    assert _ours() == before  # rank 0 unlinked its file even so


def test_bad_row_size_non_cpu_or_strided_tensors_and_weakly_ordered_hosts_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="multiple of 64"):
        ShmAllreduce(None, rank=0, world=2, timeout_s=1.0, row_bytes=100)
    shm = ShmAllreduce.__new__(ShmAllreduce)
    shm.world = 2
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        ShmAllreduce.__call__(shm, torch.ones(4, 4).t())
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    with pytest.raises(ValueError, match="x86-64's store order.*aarch64"):
        ShmAllreduce(None, rank=0, world=2, timeout_s=1.0)


class _Full(ShmAllreduce):
    """Rank 0 finds /dev/shm full when it reserves the file."""

    def _map_file(self, path, size, *, create):
        if create:
            raise OSError(28, "No space left on device")
        super()._map_file(path, size, create=create)


def test_a_full_shm_fails_setup_on_every_rank_and_rank_0_says_why():
    errors: dict[int, str] = {}
    before = _ours()

    def body(tp, r):
        try:
            _Full(tp.pg, rank=r, world=3, timeout_s=10.0, row_bytes=64)(torch.ones(10))
        except CollectiveError as e:
            errors[r] = str(e)

    on_ranks(3, body)
    assert "could not reserve" in errors[0] and "No space left" in errors[0] and "--collectives gloo" in errors[0]
    assert all("rank 0 could not make" in errors[r] for r in (1, 2)), errors
    assert _ours() == before


@given(world=st.integers(2, 8), free=st.integers(0, 4 << 30), row=st.integers(1, 64 << 20).map(lambda b: b // 64 * 64 or 64))
def test_rows_shrink_to_half_the_free_space_and_too_little_is_refused(world, free, row):
    try:
        got = fit_rows(row, world, free)
    except OSError:
        assert 2 * world * MIN_ROW_BYTES + 64 * world > free // 2  # not even the smallest rows fit in half
        return
    assert MIN_ROW_BYTES <= got or got == row
    assert got <= row and got % 64 == 0
    assert 2 * world * got + 64 * world <= free // 2  # the file takes at most half of what is free
