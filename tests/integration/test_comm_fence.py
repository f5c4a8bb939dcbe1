"""Retiring a generation is a fence (issue 12, item 6): a delayed late sender on the old
group can never write into a buffer the next generation reuses.

Two real processes over gloo, coordinated through a TCPStore the test hosts. Rank 1 issues
an op into buffer B that rank 0 does not answer, and retires generation 0: the op must be
over when retire() returns. Only then does rank 0 send its data on the retired group; B
must stay as it was, and a generation-1 group over the same B must deliver the right values.
"""
from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest
import torch.distributed as dist

from .conftest import spawn_ranks

pytestmark = pytest.mark.timeout(120)

N = 1 << 16  # 256 KiB of float32: more than a socket buffer, so a late send cannot hide in the kernel
LATE, FRESH = 5.0, 7.0


def _comm(store, rank: int, gen: int):
    from unbroken.comm.group import Comm

    return Comm(dist.PrefixStore(f"gen{gen}/", store), rank=rank, world=2, gen=gen, timeout_s=30)


def _issue(comm, op: str, buf, rank: int):
    """Rank 1's receive of rank 0's data into `buf`, or rank 0's matching send."""
    if op == "recv":
        return comm.recv_start(buf, src=0, tag=1) if rank == 1 else comm.send_start(buf, dst=1, tag=1)
    return comm.allreduce_start(buf, what=f"all-reduce rank {rank}")


def _late_sender(port: int, op: str) -> dict:
    """Rank 0: answers generation 0 only after rank 1 retired it, then joins generation 1."""
    import torch

    from unbroken.comm.group import CollectiveError

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    comm = _comm(store, 0, 0)
    store.wait(["retired"], timedelta(seconds=30))
    late = torch.full((N,), LATE)
    try:
        comm.finish(_issue(comm, op, late, 0))
        late_error = None
    except CollectiveError as e:  # rank 1 shut its sockets: the late op fails (at issue, or in finish)
        late_error = str(e)[:200]
    comm.retire()
    store.set("late_done", "1")
    new = _comm(store, 0, 1)
    fresh = torch.full((N,), FRESH)
    new.finish(_issue(new, op, fresh, 0))
    new.retire()
    return {"late_error": late_error}


def _retirer(port: int, op: str) -> dict:
    """Rank 1: issues into B, retires generation 0 with the op still pending, reuses B in generation 1."""
    import time

    import torch

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    comm = _comm(store, 1, 0)
    buf = torch.zeros(N)
    pending = _issue(comm, op, buf, 1)
    t0 = time.perf_counter()
    comm.retire()
    fence_ms = (time.perf_counter() - t0) * 1e3
    done_at_return = pending.done.is_set()
    store.set("retired", "1")
    store.wait(["late_done"], timedelta(seconds=30))
    time.sleep(0.5)  # room for a late byte to land, were the old group still able to write
    untouched = bool((buf == 0).all())
    new = _comm(store, 1, 1)
    new.finish(_issue(new, op, buf, 1))
    new.retire()
    # recv: rank 0's FRESH; all-reduce: rank 0's FRESH + rank 1's (untouched) zeros
    return {"done_at_return": done_at_return, "failed": bool(pending.error), "untouched": untouched,
            "gen1_ok": bool((buf == FRESH).all()), "fence_ms": fence_ms}


def _run(rank: int, port: int, op: str, out: mp.Queue) -> None:
    import os

    try:
        out.put((rank, (_late_sender if rank == 0 else _retirer)(port, op)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, {"error": repr(e)}))
    out.close()
    out.join_thread()
    # As unbroken's launcher: skip interpreter teardown, where gloo groups kept alive on
    # purpose (retired generations) may abort in their destructors.
    os._exit(0)


@pytest.mark.parametrize("op", ["recv", "allreduce"])
def test_retire_is_a_fence_against_a_delayed_late_sender(op):
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    results = dict(spawn_ranks(_run, master.port, op))
    assert "error" not in results[0] and "error" not in results[1], results
    r1 = results[1]
    print(f"{op}: fence with one pending op took {r1['fence_ms']:.2f} ms; late send: {results[0]['late_error']}")
    assert r1["done_at_return"], "the retired generation's op was still running when retire() returned"
    assert r1["failed"], "an op its peer never answered must have failed"
    assert r1["untouched"], "the late sender's data landed in a buffer after its generation retired"
    assert r1["gen1_ok"], "generation 1 over the same buffer did not deliver the right values"


class _StuckWork:
    """An op that never ends on its own (stuck in native code): wait() blocks until released."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()

    def wait(self) -> bool:
        return self.release.wait(30)


def _solo_comm(gen: int):
    """A real one-rank gloo group in this process."""
    from unbroken.comm.group import Comm

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return Comm(dist.PrefixStore(f"solo{gen}/", store), rank=0, world=1, gen=gen, timeout_s=30)


def test_an_op_stuck_past_the_fence_raises_abandoned_ops_stuck_naming_generation_and_op():
    from unbroken.comm.group import AbandonedOpsStuck, CollectiveError

    comm = _solo_comm(3)
    stuck = _StuckWork()
    comm.start(stuck, "tier-1 receive of shard 2")
    try:
        with pytest.raises(AbandonedOpsStuck, match=r"generation 3 .*tier-1 receive of shard 2") as info:
            comm.retire(fence_s=0.2)
        assert not isinstance(info.value, CollectiveError)  # nothing may catch it as a retryable failure
    finally:
        stuck.release.set()


def test_a_retired_group_takes_no_more_ops():
    import torch

    from unbroken.comm.group import CollectiveError

    comm = _solo_comm(4)
    comm.allreduce(torch.ones(4))  # the waiter thread exists and is idle: the fence passes at once
    comm.retire()
    comm.retire()  # idempotent
    with pytest.raises(CollectiveError, match="generation 4 is retired"):
        comm.allreduce_start(torch.ones(4))
    with pytest.raises(CollectiveError, match="generation 4 is retired"):
        comm.start(_StuckWork(), "late op")
