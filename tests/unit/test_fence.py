"""A follower's self-fence (runtime/fence.py): fires once, only after fence_after_s without a renewal."""
import threading

import pytest
from hypothesis import given, strategies as st

from unbroken.events import EventLog, read_events
from unbroken.runtime.fence import LeaseFence


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@given(st.lists(st.floats(0.0, 3.0), min_size=1, max_size=30))
def test_it_fences_exactly_when_a_gap_between_renewals_exceeds_the_limit(gaps):
    clock, fired = Clock(), []
    fence = LeaseFence(2.4, fired.append, clock=clock)
    expect = None
    for g in gaps:
        clock.t += g
        fence.check()
        if expect is None and g > 2.4:
            expect = g
        fence.renewed()
    assert (fired == [pytest.approx(expect)]) if expect is not None else fired == []
    fence.check()
    assert len(fired) <= 1  # once, whatever follows


def test_the_thread_fences_a_loop_that_stopped_renewing():
    done = threading.Event()
    fence = LeaseFence(0.2, lambda age: done.set(), poll_s=0.01).start()
    try:
        assert done.wait(5.0) and fence.fenced_age_s > 0.2
    finally:
        fence.stop()


def test_bad_limit_and_a_sealed_log_writes_nothing_more(tmp_path):
    with pytest.raises(ValueError, match="fence_after_s must be > 0"):
        LeaseFence(0, print)
    log = EventLog(tmp_path / "events.jsonl", source="supervisor", node=1)
    log.emit("node_fenced", node=1, lease_age_s=2.5, fence_after_s=2.4)
    log.seal()
    log.emit("warning", message="after the fence")
    assert [e.kind for e in read_events(tmp_path)] == ["node_fenced"]
