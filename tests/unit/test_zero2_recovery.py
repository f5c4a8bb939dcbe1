"""Which rank hands a new member each region of the parameters after a zero2 step cut short."""
from __future__ import annotations

from hypothesis import given, strategies as st

from unbroken.runtime.zero2_recovery import region_sources, update_done


def _status(rank, *, new=False, snap_ver=4, gathering=4, chunks=(4, 5), parity=(4, 5)):
    return {"rank": rank, "new": new, "snap_ver": None if new else snap_ver, "gathering": gathering,
            "chunks": None if new else list(chunks), "parity_ver": None if new else list(parity)}


def test_a_survivors_region_comes_from_its_snapshot_a_lost_one_from_an_untouched_copy():
    status = [_status(0), _status(1, new=True), _status(2, gathering=5), _status(3)]
    got = region_sources(status, 4)
    assert got == {0: (0, "snapshot"), 1: (0, "copy"), 2: (2, "snapshot"), 3: (3, "snapshot")}


def test_a_copy_is_never_taken_from_a_rank_that_entered_the_all_gather():
    status = [_status(0, gathering=5), _status(1, new=True), _status(2, gathering=5), _status(3)]
    assert region_sources(status, 4)[1] == (3, "copy")


def test_no_untouched_copy_means_none():
    status = [_status(0, gathering=5), _status(1, new=True)]
    assert region_sources(status, 4) is None


@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=2, max_size=9))
def test_every_region_has_a_source_that_holds_it_at_the_step(flags):
    status = [_status(r, new=new, gathering=5 if entered else 4, snap_ver=4 if fresh else 3)
              for r, (new, entered, fresh) in enumerate(flags)]
    got = region_sources(status, 4)
    untouched = [s["rank"] for s in status if not s["new"] and s["gathering"] != 5]
    orphan = any(not (not s["new"] and s["snap_ver"] == 4) and not [u for u in untouched if u != s["rank"]]
                 for s in status)
    assert (got is None) == orphan
    if got is None:
        return
    assert set(got) == set(range(len(flags)))
    for r, (src, kind) in got.items():
        s = status[src]
        assert not s["new"]
        if kind == "snapshot":
            assert src == r and s["snap_ver"] == 4
        else:
            assert src != r and s["gathering"] != 5


def test_update_done_needs_every_chunk_and_window_at_the_step():
    assert update_done([_status(0, chunks=(5, 5), parity=(5, 5))], 5)
    assert not update_done([_status(0, chunks=(5, 5), parity=(5, 5)), _status(1, chunks=(4, 5), parity=(5, 5))], 5)
    assert not update_done([_status(0, chunks=(5, 5), parity=(4, 5))], 5)
