"""A transfer's completion (comm/transport.py): pending until its waiter finishes it, then done for good."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from unbroken.comm.transport import Transfer, Transport

pytestmark = pytest.mark.timeout(30)


def _transfer() -> Transfer:
    return Transfer("recv", peer=1, tag=7, nbytes=4096, work=None)


def test_a_pending_transfer_times_out_and_stays_pending():
    x = _transfer()
    assert not x.wait_done(0.0)
    assert not x.wait_done(0.01)
    assert x.ended == 0.0


def test_a_finished_transfer_is_done_for_every_later_wait():
    x = _transfer()
    x.ended = 123.0
    x.finish()
    assert all(x.wait_done(0.0) for _ in range(3))
    assert x.ended == 123.0


def test_a_wait_ends_when_another_thread_finishes_the_transfer():
    x, started = _transfer(), threading.Event()

    def waiter_thread():
        started.wait(5)
        x.ended = 1.0
        x.finish()

    t = threading.Thread(target=waiter_thread)
    t.start()
    started.set()
    try:
        assert x.wait_done(10.0)
    finally:
        t.join(5)
    assert x.ended == 1.0


def test_a_negative_timeout_is_a_poll_not_an_error():
    x = _transfer()
    assert not x.wait_done(-1.0)
    x.finish()
    assert x.wait_done(-1.0)


def test_scratch_keeps_one_buffer_per_slot_growing_to_the_largest_size():
    tp = Transport(None, rank=0, world=2, timeout_s=1.0)
    a = tp.scratch(1, 100, torch.float32)
    assert a.shape == (100,) and a.dtype == torch.float32
    assert tp.scratch(1, 50, torch.float32).data_ptr() == a.data_ptr()  # smaller: the same memory
    assert tp.scratch(1, 200, torch.bfloat16).data_ptr() == a.data_ptr()  # 400 bytes, as many as before
    b = tp.scratch(2, 100, torch.float32)
    assert b.data_ptr() != a.data_ptr()  # another slot: other memory
    c = tp.scratch(1, 101, torch.float32)
    assert c.shape == (101,) and c.data_ptr() != a.data_ptr()  # larger: grown
    assert tp.scratch(1, 10, torch.int64).data_ptr() == c.data_ptr()


def test_gloos_timeout_just_before_our_deadline_is_reported_as_the_deadline():
    """gloo waits whole milliseconds of what is left ("Timed out waiting 998ms" for a 1 s deadline),
    so its timeout can fire just before the deadline by our clock: that failure names the deadline.
    An error well before it keeps its own words."""
    from unbroken.comm.group import CollectiveError
    from unbroken.comm.transport import GLOO_CLOCK_SLACK_S

    for left, words in ((GLOO_CLOCK_SLACK_S / 5, "did not end within 1.0s"), (30.0, "failed: peer closed")):
        tp = Transport(None, rank=0, world=2, timeout_s=1.0)
        tp.begin()
        tp._deadline = time.monotonic() + left
        x = _transfer()
        x.error = RuntimeError("peer closed\nmore")
        with pytest.raises(CollectiveError, match=words):
            tp._fail("all-reduce (piece 0)", x)
        assert tp.broken and words in tp.broken
