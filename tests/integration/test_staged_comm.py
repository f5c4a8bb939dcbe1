"""Comm's collectives staged through host memory (comm/staged.py), the path of ranks that share a
GPU under gloo. Here host tensors are staged anyway (StagedGroup(always=True)), so the copies in
and out are exercised without a GPU; tests/gpu runs the same member on CUDA tensors."""
from __future__ import annotations

import functools
import multiprocessing as mp
from datetime import timedelta

import pytest

from tests.integration.conftest import spawn_ranks
from unbroken.bench.common import free_port

pytestmark = pytest.mark.timeout(120)


def _rows(world: int, n: int, seed: int):
    import torch

    return [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed * 31 + r)) for r in range(world)]


def _checks(comm, rank: int, world: int, dev) -> dict:
    """Every op Comm offers, on tensors on `dev`, against what the inputs say it must give."""
    import torch

    from unbroken.comm.bitwise import fold, int_view

    n, out = 1000, {}
    rows = _rows(world, n, 1)
    t = rows[rank].float().to(dev, copy=True)
    comm.allreduce(t, what="sum")
    out["sum"] = t.device == dev and torch.equal(t.cpu(), sum(r.float() for r in rows))
    ints = [r.to(torch.int32) for r in rows]
    t = ints[rank].to(dev, copy=True)
    comm.xor_allreduce(t, what="xor")
    out["xor"] = torch.equal(int_view(t).cpu(), fold(torch.stack([int_view(x) for x in ints]), "xor"))
    t = ints[rank].to(dev, copy=True)
    comm.xor_reduce(t, world - 1, what="xor reduce")
    want = fold(torch.stack([int_view(x) for x in ints]), "xor") if rank == world - 1 else None
    out["xor reduce"] = want is None or torch.equal(int_view(t).cpu(), want)
    t = ints[rank].to(dev, copy=True)
    comm.broadcast(t, 1, what="broadcast")
    out["broadcast"] = torch.equal(t.cpu(), ints[1])
    inp = torch.stack([torch.full((4,), 100 * rank + s, dtype=torch.int32) for s in range(world)]).to(dev)
    got = torch.zeros_like(inp)
    comm.finish(comm.alltoall_start(got, inp, what="all-to-all"))
    out["all-to-all"] = all(int(got[m, 0]) == 100 * m + rank for m in range(world)) and got.device == dev
    send = torch.full((7,), float(rank), device=dev)
    recv = torch.zeros(7, device=dev)
    p_send = comm.send_start(send, (rank + 1) % world, tag=3)
    p_recv = comm.recv_start(recv, (rank - 1) % world, tag=3)
    comm.finish(p_send)
    comm.finish(p_recv)
    out["send/recv"] = recv.cpu().tolist() == [float((rank - 1) % world)] * 7
    full = torch.cat(rows).float().to(dev) + rank  # (world * n,)
    shard = torch.zeros(n, device=dev)
    comm.reduce_scatter(shard, full, what="reduce-scatter")
    out["reduce-scatter"] = torch.equal(shard.cpu(), world * rows[rank].float() + sum(range(world)))
    gathered = torch.zeros(world * n, device=dev)
    gathered[rank * n:(rank + 1) * n] = rows[rank].float().to(dev, copy=True)
    comm.allgather_into(gathered, gathered[rank * n:(rank + 1) * n], what="all-gather in place")
    out["all-gather"] = torch.equal(gathered.cpu(), torch.cat(rows).float())
    table = torch.zeros((world, 3), device=dev) if rank == 0 else None
    comm.finish(comm.gather_start(table, torch.full((3,), float(rank), device=dev), 0, what="gather"))
    out["gather"] = table is None or table.cpu()[:, 0].tolist() == [float(r) for r in range(world)]
    mask = torch.tensor([(0b1111 << rank) | (1 << 62)], dtype=torch.int64, device=dev)
    comm.and_allreduce(mask, what="and")
    out["and"] = int(mask) == functools.reduce(lambda a, b: a & b, [(0b1111 << r) | (1 << 62) for r in range(world)])
    out["control"] = comm.allgather_json({"r": rank}) == [{"r": r} for r in range(world)]
    return out


def staged_member(rank: int, port: int, world: int, place: str, out: mp.Queue) -> None:
    """One rank: its Comm on gloo, with device tensors (place "cuda": every rank on GPU 0) or host
    tensors forced through the staging (place "host")."""
    import torch
    import torch.distributed as dist

    from unbroken.comm.group import Comm
    from unbroken.comm.staged import StagedGroup

    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        comm = Comm(dist.PrefixStore("staged/", store), rank=rank, world=world, gen=0, timeout_s=60, backend="gloo")
        if place == "cuda":
            torch.cuda.set_device(0)
            dev = torch.device("cuda", 0)
            paths = {"cuda tensors staged": comm._pg(torch.zeros(1, device=dev)) is comm.staged,
                     "host tensors direct": comm._pg(torch.zeros(1)) is comm.pg}
        else:
            dev = torch.device("cpu")
            comm.staged = StagedGroup(comm.pg, always=True)
            comm._pg = lambda t: comm.staged  # every op through the staging, host tensors included
            paths = {}
        checks = {**paths, **_checks(comm, rank, world, dev), "bitwise native": comm.bitwise_path(
            torch.zeros(1, dtype=torch.int32, device=dev)) == "native"}
        comm.retire()
        out.put((rank, checks))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}"))


def check_staged(world: int, place: str) -> None:
    results = dict(spawn_ranks(staged_member, free_port(), world, place, world=world, timeout_s=100))
    for r in range(world):
        assert isinstance(results[r], dict), results[r]
        assert all(results[r].values()), {k: v for k, v in results[r].items() if not v}


def test_every_op_staged_through_host_copies_gives_what_its_inputs_say():
    check_staged(3, "host")
