"""The exchange path for XOR/AND (comm/bitwise.py, what NCCL groups use) against gloo's own
BXOR/BAND, over real gloo groups of 2-4 processes: bitwise the same, for any size and dtype."""
from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest

from unbroken.bench.common import free_port
from .conftest import spawn_ranks

pytestmark = pytest.mark.timeout(180)

DTYPES = ("int32", "int64", "uint8", "int16", "float32", "bfloat16", "float64", "bool")


def _rank_tensor(seed: int, rank: int, dtype_name: str, n: int):
    """Rank's random bytes for one case, as a tensor of `dtype_name` (every rank can rebuild any rank's)."""
    import torch

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed * 101 + rank)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype) if dtype != torch.bool else raw.bitwise_and(1).view(torch.bool)


def _check_case(comm, world: int, seed: int, dtype_name: str, n: int) -> None:
    import torch
    import torch.distributed as dist

    from unbroken.comm.bitwise import fold, int_view

    mine = _rank_tensor(seed, comm.rank, dtype_name, n)
    every = torch.stack([int_view(_rank_tensor(seed, r, dtype_name, n)) for r in range(world)]) if n else None
    for op, native in (("xor", dist.ReduceOp.BXOR), ("and", dist.ReduceOp.BAND)):
        got = mine.clone()
        (comm.xor_allreduce if op == "xor" else comm.and_allreduce)(got, what=f"{op} {dtype_name}x{n}")
        ref = int_view(mine.clone())
        if n:
            comm.allreduce(ref, op=native, what=f"native {op}")
            assert torch.equal(int_view(got), ref), (op, dtype_name, n)
            assert torch.equal(ref, fold(every, op)), (op, dtype_name, n)
    dst = seed % world
    got, ref = mine.clone(), int_view(mine.clone())
    comm.finish(comm.xor_reduce_start(got, dst, what="xor reduce"))
    if n:
        comm.reduce(ref, dst, dist.ReduceOp.BXOR, what="native xor reduce")
    if comm.rank == dst and n:
        assert torch.equal(int_view(got), ref) and torch.equal(ref, fold(every, "xor")), (dtype_name, n)
    elif comm.rank != dst:
        assert torch.equal(int_view(got), int_view(mine)), "a reduce must leave the other ranks' tensors as they were"


def _lead(comm, world: int) -> None:
    """Rank 0 draws the cases (hypothesis) and sends each to the group before running it; then None."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 1 << 20), dtype_name=st.sampled_from(DTYPES),
           n=st.one_of(st.integers(0, 9), st.integers(10, 3000)))
    def cases(seed: int, dtype_name: str, n: int) -> None:
        comm.allgather_json([seed, dtype_name, n], what="next case")
        _check_case(comm, world, seed, dtype_name, n)

    try:
        cases()
    finally:
        comm.allgather_json(None, what="no more cases")


def _follow(comm, world: int) -> None:
    """Run every case rank 0 sends, to the end (a failure is raised after the last case)."""
    failed = None
    while (case := comm.allgather_json(None, what="next case")[0]) is not None:
        try:
            _check_case(comm, world, *case)
        except AssertionError as e:
            failed = failed or AssertionError(f"case {case}: {e}")
    if failed:
        raise failed


def _member(rank: int, port: int, out: mp.Queue) -> None:
    """Rank `rank` of a 4-process job: joins the groups of 2, 3 and 4 it belongs to, one after another."""
    import torch.distributed as dist

    from unbroken.comm.group import Comm

    try:
        store = dist.TCPStore("127.0.0.1", port, 4, rank == 0, timeout=timedelta(seconds=60))
        for world in (2, 3, 4):
            if rank < world:
                comm = Comm(dist.PrefixStore(f"w{world}/", store), rank=rank, world=world, gen=0, timeout_s=60,
                            bitwise_reduce="exchange")
                (_lead if rank == 0 else _follow)(comm, world)
        out.put((rank, "ok"))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}"))


def test_exchange_xor_and_equal_gloo_bitwise_ops_in_groups_of_2_3_and_4():
    results = dict(spawn_ranks(_member, free_port(), world=4, timeout_s=150))
    assert results == {r: "ok" for r in range(4)}, results
