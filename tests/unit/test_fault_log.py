"""The fault log survives a reporter caught between its two writes (issue 12, item 2).

`report_fault` reserves an index (`add`) and then writes the record (`set`); a reader
that skipped an index whose record had not landed yet lost that fault forever.
"""
from __future__ import annotations

import itertools
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.runtime import membership
from unbroken.runtime.membership import FaultLogReader

pytestmark = pytest.mark.timeout(60)

_prefix = itertools.count()


@pytest.fixture(scope="module")
def master() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _fresh(master: dist.TCPStore) -> dist.PrefixStore:
    """An empty fault log on the shared real store."""
    return dist.PrefixStore(f"log{next(_prefix)}/", master)


class _PausedAfterAdd:
    """A store proxy whose `set` blocks until released: the reporter's index is reserved but
    its record has not landed (the injected delay between report_fault's two writes)."""

    def __init__(self, store: dist.Store) -> None:
        self._store, self.added, self.release = store, threading.Event(), threading.Event()

    def add(self, key: str, n: int) -> int:
        try:
            return self._store.add(key, n)
        finally:
            self.added.set()

    def set(self, key: str, value: str) -> None:
        assert self.release.wait(10), "the test never released the paused reporter"
        self._store.set(key, value)


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_record_that_lands_after_a_take_is_delivered_late_not_skipped(master):
    store = _fresh(master)
    reader = FaultLogReader(store)
    slow = _PausedAfterAdd(store)
    t = threading.Thread(target=membership.report_fault, args=(slow, {"proc": "slow", "fault": "exit"}))
    t.start()
    try:
        assert slow.added.wait(10)
        membership.report_fault(store, {"proc": "fast", "fault": "exit"})  # index 1, complete
        assert reader.take() == [{"proc": "fast", "fault": "exit"}]
        assert reader.pending == [0]
    finally:
        slow.release.set()
        t.join(10)
    assert reader.take() == [{"proc": "slow", "fault": "exit"}]
    assert reader.take() == [] and reader.pending == [] and reader.lost == []


def test_a_record_that_never_lands_is_reported_lost_once_after_give_up(master):
    store, clock, lost = _fresh(master), _Clock(), []
    reader = FaultLogReader(store, give_up_s=5.0, clock=clock, on_lost=lambda i, w: lost.append((i, w)))
    store.add("faults/n", 1)  # a reporter died between its two writes
    membership.report_fault(store, {"proc": "b", "fault": "exit"})
    assert reader.take() == [{"proc": "b", "fault": "exit"}]
    clock.t = 4.9
    assert reader.take() == [] and lost == [] and reader.pending == [0]
    clock.t = 5.0
    assert reader.take() == [] and lost == [(0, 5.0)] and reader.lost == [0]
    clock.t = 100.0
    assert reader.take() == [] and lost == [(0, 5.0)] and reader.pending == []


def test_records_present_together_come_in_index_order(master):
    store = _fresh(master)
    reader = FaultLogReader(store)
    for i in range(5):
        membership.report_fault(store, {"i": i})
    assert [r["i"] for r in reader.take()] == list(range(5))


def test_give_up_must_be_positive(master):
    with pytest.raises(ValueError, match="give_up_s"):
        FaultLogReader(_fresh(master), give_up_s=0)


def _schedules(max_reporters: int = 5):
    """Interleavings: each reporter's add precedes its set (or it dies before setting);
    takes and clock advances fall anywhere."""

    @st.composite
    def build(draw):
        k = draw(st.integers(1, max_reporters))
        dies = draw(st.lists(st.booleans(), min_size=k, max_size=k))
        events = [("add", r) for r in range(k)] + [("set", r) for r in range(k) if not dies[r]]
        events += [("take", None)] * draw(st.integers(0, 2 * k)) + [("tick", None)] * draw(st.integers(0, 3))
        order = draw(st.permutations(events))
        # Repair causality: a reporter's set goes after its add.
        seen, out, deferred = set(), [], {}
        for kind, r in order:
            if kind == "set" and r not in seen:
                deferred[r] = True
                continue
            out.append((kind, r))
            if kind == "add":
                seen.add(r)
                if deferred.pop(r, False):
                    out.append(("set", r))
        return k, dies, out

    return build()


@settings(max_examples=150)
@given(_schedules())
def test_every_record_exactly_once_and_every_dead_reservation_lost_once(master, schedule):
    k, dies, steps = schedule
    store, clock, lost = _fresh(master), _Clock(), []
    reader = FaultLogReader(store, give_up_s=10.0, clock=clock, on_lost=lambda i, w: lost.append(i))
    index, delivered = {}, []

    def take() -> None:
        got = [r["who"] for r in reader.take()]
        assert [index[w] for w in got] == sorted(index[w] for w in got), "one take is in index order"
        delivered.extend(got)

    for kind, r in steps:
        if kind == "add":
            index[r] = store.add("faults/n", 1) - 1
        elif kind == "set":
            membership.put(store, membership.fault_key(index[r]), {"who": r})
        elif kind == "take":
            take()
        else:
            clock.t += 3.0  # below give_up_s: a late record is still waited for
    take()
    clock.t += 10.0
    take()
    assert sorted(delivered) == sorted(r for r in range(k) if not dies[r])  # each exactly once
    assert sorted(lost) == sorted(index[r] for r in range(k) if dies[r])
    assert reader.lost == lost and reader.pending == []
