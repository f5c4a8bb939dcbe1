"""The compiled ring walk (comm/ring_walk.cpp, native_ring.py) gives the Python walk's bits, is the
walk that runs when the caller waits inside gloo, and fails like it: a deadline is a CollectiveError
naming the peer (a dead peer and a newer generation: test_comm_dead_peer, test_comm_untimed_wait)."""
from __future__ import annotations

import itertools
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.commgroups import fresh_groups
from tests.unit.test_comm_patterns import DTYPES, _inputs, _run
from unbroken.comm import native_ring
from unbroken.comm.group import CollectiveError
from unbroken.comm.patterns import Pattern, allreduce
from unbroken.comm.transport import Transport

pytestmark = pytest.mark.timeout(300)
_seq = itertools.count(500)


@pytest.fixture(scope="module")
def walk():
    why = native_ring.build()
    if why:
        pytest.skip(why)
    return native_ring.module()


class _Counting:
    """The compiled module, counting its walks."""

    def __init__(self, m) -> None:
        self.m, self.calls, self._lock = m, 0, threading.Lock()

    def walk_ring(self, *a):
        with self._lock:
            self.calls += 1
        return self.m.walk_ring(*a)


def _bits(ts: list[torch.Tensor]) -> list[bytes]:
    return [t.view(torch.uint8).numpy().tobytes() for t in ts]


@settings(max_examples=25, deadline=None)
@given(world=st.integers(2, 8), n=st.integers(1, 300), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31),
       data=st.data())
def test_the_compiled_walk_gives_the_python_walks_and_the_references_bits(walk, world, n, dtype, seed, data):
    order = tuple(data.draw(st.permutations(range(world))))
    split = tuple(data.draw(st.lists(st.integers(0, 5), min_size=world, max_size=world)))
    ring = Pattern(kind="ring", order=order, split=split if sum(split) else (1,) * world,
                   pieces=data.draw(st.integers(1, 5)), window=data.draw(st.integers(0, 5)))
    xs = _inputs(world, n, dtype, seed)
    want = _bits(_run(world, xs, None))
    counting = _Counting(walk)
    try:
        native_ring._loaded["m"] = counting
        compiled = _bits(_run(world, xs, ring, timed=False))
        assert counting.calls == world  # every rank walked compiled
        native_ring._loaded["m"] = None  # built, but off: the Python walk, untimed
        python = _bits(_run(world, xs, ring, timed=False))
    finally:
        native_ring._loaded["m"] = walk
    assert compiled == want and python == want, ring


def test_a_peer_that_never_sends_fails_the_compiled_walk_at_the_deadline_naming_it(walk):
    pgs = fresh_groups(2)  # not shared: receives stay posted on it. Rank 1 keeps its links up and sends nothing
    tp = Transport(pgs[0], rank=0, world=2, timeout_s=1.0)
    t = torch.ones(1000)
    with pytest.raises(CollectiveError, match=r"rank 0/2: all-reduce \(.*\): recv with rank 1 did not end within 1\.0s"):
        allreduce(tp, t, Pattern.static_ring(2, 3), next(_seq), timed=False)
    assert tp.broken and torch.equal(t[:10], torch.ones(10))  # my half was not yet reduced: untouched bits
    with pytest.raises(CollectiveError, match="already failed"):
        allreduce(tp, t, Pattern.static_ring(2, 3), next(_seq), timed=False)


@pytest.mark.parametrize("collectives,plan,builds", [("gloo", None, False), ("adaptive", None, True),
                                                     ("static", None, True), ("chain", None, False),
                                                     ("gloo", "static", True), ("gloo", "shm", False)])
def test_the_launcher_builds_the_walk_when_our_ring_is_named(monkeypatch, tmp_path, collectives, plan, builds):
    """By --collectives or by a plan file's `collectives`, before any rank starts (runtime/command.py)."""
    import json

    from unbroken.config import RunConfig
    from unbroken.runtime import command
    from unbroken.runtime.overlap_tune import checked_overlap

    built = []
    monkeypatch.setattr(native_ring, "module", lambda: None)
    monkeypatch.setattr(native_ring, "build", lambda: built.append(True))
    cfg = RunConfig().replace(collectives=collectives)
    if plan:
        f = tmp_path / "plan.json"
        f.write_text(json.dumps({"format": "unbroken-overlap/1", "plan": {"bucket_kb": 32, "collectives": plan}}))
        cfg = cfg.replace(overlap=str(f))
    command._build_ring_walk(*checked_overlap(cfg))
    assert built == ([True] if builds else [])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_compiled_walk_wraps_integer_sums_as_torch_does(walk, dtype):
    """Sums past the type's range wrap (two's complement) exactly as torch's add_ wraps them."""
    top = torch.iinfo(dtype).max
    xs = [torch.full((500,), top - r, dtype=dtype) for r in range(4)]
    xs[2][::3] = torch.iinfo(dtype).min + 7
    want = _bits(_run(4, xs, None))
    assert _bits(_run(4, xs, Pattern.static_ring(4, 3), timed=False)) == want
