"""Comm and GenerationWatch over a real TCPStore and gloo group (two processes)."""
from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest

from tests.procs import free_port

from .conftest import spawn_ranks

pytestmark = pytest.mark.timeout(120)


def _member(rank: int, port: int, objs: list, out: mp.Queue) -> None:
    import torch.distributed as dist

    from unbroken.comm.group import Comm
    from unbroken.runtime import membership

    try:
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
        comm = Comm(dist.PrefixStore("t/", store), rank=rank, world=2, gen=0, timeout_s=30)
        got = [comm.allgather_json(o, what=f"object {i}") for i, o in enumerate(objs[rank])]
        watch = membership.GenerationWatch(
            lambda: membership.connect_store("127.0.0.1", port, timeout_s=30), poll_s=0.5)
        comm.barrier()
        if rank == 0:
            membership.publish(store, membership.Generation(1, {0: "a", 1: "b"}, (), "test"))
        seen = watch.wait_newer(0, timeout_s=10)
        comm.barrier()
        out.put((rank, got, seen, watch.latest))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, repr(e), None, None))


def test_allgather_json_small_and_larger_than_one_slot_and_generation_watch():
    big = "x" * (40 << 10)  # larger than the 16 KiB first-round slot: a second round follows
    objs = [[{"r": 0}, big, [1, 2]], [{"r": 1}, "small", big]]
    results = {r: (got, seen, latest) for r, got, seen, latest in spawn_ranks(_member, free_port(), objs)}
    for r in range(2):
        got, seen, latest = results[r]
        assert got == [[{"r": 0}, {"r": 1}], [big, "small"], [[1, 2], big]], got
        assert seen is True and latest == 1


class _Payload:
    """Unpickling this runs code: it creates the file named `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickle_sender(rank: int, port: int, marker: str, out: mp.Queue) -> None:
    import pickle

    import torch.distributed as dist

    from unbroken.comm.group import BadControlMessage, Comm

    try:
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
        comm = Comm(dist.PrefixStore("t/", store), rank=rank, world=2, gen=0, timeout_s=30)
        if rank == 1:  # a peer that sends a pickle where a control message goes
            comm.allgather_bytes(pickle.dumps(_Payload(marker)), what="recovery status")
            out.put((rank, "sent"))
        else:
            try:
                comm.allgather_json({"rank": 0}, what="recovery status")
                out.put((rank, "accepted"))
            except BadControlMessage as e:
                out.put((rank, f"refused: {e}"))
        comm.barrier()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, repr(e)))


def test_a_pickle_payload_in_a_control_message_is_refused_and_never_unpickled(tmp_path):
    marker = tmp_path / "code-ran"
    results = dict(spawn_ranks(_pickle_sender, free_port(), str(marker)))
    assert results[1] == "sent"
    assert results[0].startswith("refused: recovery status: rank 1 sent"), results[0]
    assert not marker.exists()  # the payload was never unpickled


def _gather_member(rank: int, port: int, n: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from unbroken.comm import group
    from unbroken.comm.group import Comm

    try:
        group.GATHER_STAGING_BYTES = 2 * 4 * 7  # pieces of 7 elements: n is not a multiple of them
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
        comm = Comm(dist.PrefixStore("g/", store), rank=rank, world=2, gen=0, timeout_s=30)
        flat = torch.full((2 * n,), -1.0)
        flat[rank * n:(rank + 1) * n] = torch.arange(n, dtype=torch.float32) + 1000 * rank
        comm.allgather_into(flat, flat[rank * n:(rank + 1) * n], what="in place")
        apart = torch.zeros(2 * n)
        comm.allgather_into(apart, torch.arange(n, dtype=torch.float32) - rank, what="separate input")
        out.put((rank, flat.tolist(), apart.tolist()))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, repr(e), None))


def test_allgather_into_in_pieces_in_place_and_from_a_separate_input():
    n = 45
    results = {r: (a, b) for r, a, b in spawn_ranks(_gather_member, free_port(), n)}
    for r in range(2):
        flat, apart = results[r]
        assert flat == [float(i) for i in range(n)] + [float(i + 1000) for i in range(n)], flat
        assert apart == [float(i) for i in range(n)] + [float(i - 1) for i in range(n)]
