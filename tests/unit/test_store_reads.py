"""The supervisor's store reads on etcd: one request per tick, answers the same as the store's
(runtime/store_reads.py), and the fault log's watch that wakes the leader (membership.FaultLogWatch)."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.runtime import membership
from unbroken.runtime.store_reads import TickReads
from unbroken.runtime.wake import ChildWake

pytestmark = pytest.mark.timeout(60)


class Batched:
    """An in-process store as EtcdStore behaves (read_many; add(key, 0) reads, it creates nothing),
    counting the requests made."""

    def __init__(self) -> None:
        self.kv = dist.HashStore()
        self.requests = 0

    def read_many(self, keys):
        self.requests += 1
        return [self.kv.get(k) if self.kv.check([k]) else None for k in keys]

    def add(self, key, amount):
        self.requests += 1
        if amount == 0 and not self.kv.check([key]):
            return 0
        return self.kv.add(key, amount)

    def __getattr__(self, name):
        fn = getattr(self.kv, name)

        def counted(*args):
            self.requests += 1
            return fn(*args)
        return counted


def test_a_tick_reads_its_keys_in_one_request_and_writes_go_through():
    store = Batched()
    store.kv.set("progress", b'{"step": 3}')
    store.kv.add("faults/n", 2)
    reads = TickReads(store)
    reads.prefetch(["abort", "progress", "faults/n", "done/0", "done/1"])
    before = store.requests
    assert not reads.check(["abort"]) and reads.check(["progress"]) and reads.get("progress") == b'{"step": 3}'
    assert reads.add("faults/n", 0) == 2 and not reads.check(["done/0", "done/1"])
    assert store.requests == before  # all answered from the tick's one read
    reads.set("done/0", "x")  # a write goes to the store and the key is read from it again
    assert reads.check(["done/0"]) and store.kv.get("done/0") == b"x"
    assert reads.add("faults/n", 1) == 3 and reads.add("faults/n", 0) == 3
    reads.drop()
    assert reads.check(["abort", "progress"]) is False and store.requests > before  # no snapshot: the store


def test_a_store_without_read_many_is_passed_through():
    store = dist.HashStore()
    reads = TickReads(store)
    reads.prefetch(["a"])
    store.set("a", "1")  # written behind the wrapper's back: still seen (no snapshot was taken)
    assert not reads.batched and reads.check(["a"]) and reads.get("a") == b"1" and reads.add("n", 2) == 2


ops = st.lists(st.tuples(st.sampled_from(["check", "get", "add0", "add", "set", "delete", "cas", "tick"]),
                         st.sampled_from(["a", "b", "c"]), st.integers(0, 3)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_answers_equal_the_stores_own_within_a_tick_of_its_own_writes(seq):
    """The naive reference (the store, every call a request) against the batched reads, same ops."""
    ref, fast_store = Batched(), Batched()
    fast = TickReads(fast_store)
    for op, key, n in seq:
        if op == "tick":
            fast.prefetch(["a", "b", "c"])
            continue
        got = []
        for s in (ref, fast):
            if op == "check":
                got.append(s.check([key]))
            elif op == "get":
                got.append(s.get(key) if s.check([key]) else None)
            elif op == "add0":
                got.append(s.add(key, 0) if not s.check([key]) or s.get(key).isdigit() else None)
            elif op == "add":
                got.append(s.add(key, n + 1) if not s.check([key]) or s.get(key).isdigit() else None)
            elif op == "set":
                got.append(s.set(key, str(n)))
            elif op == "delete":
                got.append(s.delete_key(key))
            else:
                got.append(s.compare_set(key, "", f"v{n}"))
        assert got[0] == got[1], (op, key, got)


def test_the_fault_watch_wakes_the_leader_when_a_record_lands():
    store = dist.HashStore()
    woken = threading.Event()
    membership.report_fault(store, {"fault": "old"})  # before the watch: the cursor is past it
    watch = membership.FaultLogWatch(lambda: store, 1, woken.set, poll_s=0.2)
    try:
        time.sleep(0.1)
        assert not watch.landed() and not woken.is_set()
        membership.report_fault(store, {"fault": "crash"})
        assert woken.wait(5) and watch.landed() and not watch.landed()  # once per batch
        store.add("faults/n", 1)  # a reservation whose record never lands ...
        membership.report_fault(store, {"fault": "hang"})  # ... and one after it: found past poll_s
        deadline = time.monotonic() + 5
        while not watch.landed() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert time.monotonic() < deadline
    finally:
        watch.close()


def test_a_poke_from_another_thread_wakes_the_wait_and_none_after_close():
    wake = ChildWake()
    try:
        threading.Timer(0.05, wake.poke).start()
        t0 = time.monotonic()
        wake.wait(5.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        wake.close()
    wake.poke()  # closed: a late watch's poke writes nowhere


def test_a_key_the_list_lacks_is_learned_after_one_tick_and_forgotten_when_unread():
    """tick_keys is a second list of what a tick reads: a key missing from it costs one request,
    once; then the prefetch takes it in, until it has gone unread for REMEMBER_TICKS ticks."""
    from unbroken.runtime.store_reads import REMEMBER_TICKS
    store = Batched()
    store.kv.set("new/reader", b"1")
    reads = TickReads(store)

    def tick(read_new: bool) -> int:
        reads.prefetch(["abort"])
        before = store.requests
        assert not reads.check(["abort"])
        if read_new:
            assert reads.get("new/reader") == b"1"
        reads.set("written", "x")  # a write and a re-read of it: to the store, never counted as missed
        assert reads.check(["written"])
        reads.drop()
        return store.requests - before - 2

    assert tick(True) == 1 and reads.missed == 1  # first tick: the unlisted read went to the store
    assert tick(True) == 0 and reads.missed == 1  # learned: answered from the tick's one read
    for _ in range(REMEMBER_TICKS + 1):
        tick(False)
    reads.prefetch(["abort"])
    assert "new/reader" not in reads._snap  # unread for REMEMBER_TICKS ticks: dropped from the prefetch
