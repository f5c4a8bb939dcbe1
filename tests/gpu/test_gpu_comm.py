"""Comm with backend nccl: CUDA tensors' collectives on NCCL, XOR/AND by exchange (NCCL has
no BXOR/BAND), control traffic on gloo. One process per GPU."""
from __future__ import annotations

import functools
import multiprocessing as mp
from datetime import timedelta

import pytest

from tests.integration.conftest import spawn_ranks
from unbroken.bench.common import free_port

from .need import GPUS, gpus

pytestmark = pytest.mark.timeout(180)


def _member(rank: int, port: int, world: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from unbroken.comm.bitwise import fold, int_view
    from unbroken.comm.group import Comm

    try:
        torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        comm = Comm(dist.PrefixStore("g/", store), rank=rank, world=world, gen=0, timeout_s=60, backend="nccl")
        checks = {}
        for n, dtype in ((1, torch.int32), (1000, torch.float32), (4097, torch.bfloat16), (3, torch.uint8)):
            rows = [torch.randint(0, 255, (n * dtype.itemsize,), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(7 * r + n)).view(dtype) for r in range(world)]
            want = fold(torch.stack([int_view(r) for r in rows]), "xor")
            t = rows[rank].cuda()
            checks[f"path {n}"] = comm.bitwise_path(t) == "exchange" and comm.bitwise_path(t.cpu()) == "native"
            comm.xor_allreduce(t, what="xor")
            checks[f"xor {n}"] = torch.equal(int_view(t).cpu(), want)
            t = rows[rank].cuda()
            comm.xor_reduce(t, world - 1, what="xor reduce")
            checks[f"reduce {n}"] = torch.equal(int_view(t).cpu(), want if rank == world - 1 else int_view(rows[rank]))
        mask = torch.tensor([(0b1111 << rank) | (1 << 62)], dtype=torch.int64, device="cuda")
        comm.and_allreduce(mask, what="and")
        expect = functools.reduce(lambda a, b: a & b, [(0b1111 << r) | (1 << 62) for r in range(world)])
        checks["and"] = int(mask) == expect
        checks["control"] = comm.allgather_json({"r": rank}) == [{"r": r} for r in range(world)]
        g = torch.full((5,), float(rank + 1), device="cuda")
        comm.allreduce(g, what="sum")
        checks["sum"] = g.cpu().tolist() == [float(sum(range(1, world + 1)))] * 5
        comm.retire()
        out.put((rank, checks))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}"))


@pytest.mark.parametrize("world", [pytest.param(1, marks=gpus(1)), pytest.param(2, marks=gpus(2)),
                                   pytest.param(max(GPUS, 3), marks=gpus(max(GPUS, 3)))])
def test_nccl_comm_xor_and_sum_and_control_messages(world):
    results = dict(spawn_ranks(_member, free_port(), world, world=world, timeout_s=150))
    for r in range(world):
        assert isinstance(results[r], dict), results[r]
        assert all(results[r].values()), {k: v for k, v in results[r].items() if not v}
