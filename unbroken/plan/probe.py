"""One rank of a topology measurement: ping-pong per pair, then collective sweeps over the group.

    python -m unbroken.plan.probe --rank R --world N --master HOST:PORT --out FILE [--max-bytes B]

Pair (i, j): a 4-byte ping-pong gives the latency alpha, a 1 MiB one the bandwidth beta (one
way each: half the round trip). Sweeps: all-reduce, reduce-scatter, all-gather and broadcast
of 1 KiB, 4 KiB, ... up to --max-bytes (the whole tensor), each timed on every rank between
barriers, small ones as a run of ops issued back to back (as a job issues them: broadcasts
async with rotating roots, waited together, as ZeRO-1's parameter sync does); the time of
a collective is its slowest rank's. A size whose first run takes over
--op-budget-s ends that collective's sweep (a thin link would otherwise spend minutes there).
Each sweep row is [bytes, seconds, cpu_block]: cpu_block is the share of the op's time its CPU
work (this process's CPU time, gloo's threads included) takes from the rank's compute when
a rank has under 2 cores of the host (`cpu_block()`); the planner cannot hide that part.
Rank 0 writes the topology JSON (`plan.topology`); every wait has a timeout.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from unbroken.plan.topology import COLLECTIVES, Topology

PING_BYTES, BW_BYTES = 4, 1 << 20


def _timed(fn, pg: dist.ProcessGroup) -> float:
    """Seconds of fn() on the slowest rank (barrier before, max-reduce after)."""
    dist.barrier(group=pg)
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=pg)
    return float(dt)


def _timed_cpu(fn, pg: dist.ProcessGroup) -> tuple[float, float]:
    """(seconds of fn() on the slowest rank, the cores fn() kept busy on an average rank: this
    process's CPU time, gloo's threads included, over its wall time)."""
    dist.barrier(group=pg)
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    dt = torch.tensor([wall], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=pg)
    used = torch.tensor([cpu / max(wall, 1e-9)], dtype=torch.float64)
    dist.all_reduce(used, group=pg)
    return float(dt), float(used) / dist.get_world_size(pg)


def cpu_block(cores_used: float, cores_per_rank: float) -> float:
    """The share of a collective's time its CPU work takes from the rank's compute: 0 when a
    rank has 2 cores or more (its compute thread and the collective each have one), else the
    cores the collective used over the rank's share of the host, at most 1."""
    if cores_per_rank >= 2:
        return 0.0
    return min(1.0, max(0.0, cores_used) / min(1.0, cores_per_rank))


def _pingpong(pg, rank: int, a: int, b: int, nbytes: int, reps: int) -> float:
    """One-way seconds for nbytes between a and b (median of reps round trips / 2); others wait."""
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    times = []
    for _ in range(reps):
        def trip() -> None:
            if rank == a:
                dist.send(buf, b, group=pg)
                dist.recv(buf, b, group=pg)
            elif rank == b:
                dist.recv(buf, a, group=pg)
                dist.send(buf, a, group=pg)
        times.append(_timed(trip, pg) / 2)
    return statistics.median(times)


def _collective(name: str, pg, world: int, nbytes: int):
    n = max(world, nbytes // 4 // world * world)  # divisible by world (reduce-scatter, all-gather)
    full, part = torch.ones(n), torch.ones(n // world)
    if name == "all_reduce":
        return lambda: dist.all_reduce(full, group=pg)
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full, group=pg)
    if name == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part, group=pg)
    if name == "broadcast":
        return lambda: dist.broadcast(full, 0, group=pg)
    raise ValueError(f"unknown collective {name!r}")


def _async_broadcasts(pg, world: int, nbytes: int):
    """`block(n)`: n broadcasts issued async and waited together, the roots in runs over the
    ranks: how ZeroRedundancyOptimizer syncs its parameters after a step (each owner's
    parameters, one broadcast per tensor, every handle waited at the end). gloo runs two ops
    at a time (two worker threads), so back-to-back small broadcasts overlap their latencies."""
    n_elems = max(world, nbytes // 4 // world * world)
    bufs = [torch.ones(n_elems) for _ in range(2)]

    def block(n: int) -> None:
        handles = [dist.broadcast(bufs[i % 2], i * world // n, group=pg, async_op=True) for i in range(n)]
        for h in handles:
            h.wait()
    return block


def _back_to_back(op, pg, first: float, reps: int, blocks: int = 5, batch=None) -> tuple[float, float]:
    """Seconds per op of n ops issued back to back (n for ~0.3 s, 5 to 40), the median of
    `blocks` such runs. Not one op between barriers: a job issues its collectives back to back
    (a bucket's all-reduce, ZeRO's per-parameter broadcasts, FSDP's per-layer gathers), the
    ranks arriving as they come, and on shared cores each op then costs its scheduling too
    (loopback, 4 ranks on 2 cores: 28 broadcasts of a small model's tensors take ~1 ms each
    back to back, ~0.5 ms one at a time)."""
    n = min(40, max(reps, int(0.3 / max(first, 1e-4))))

    def block() -> None:
        if batch is not None:  # the job issues these async and waits for them together
            batch(n)
            return
        for _ in range(n):
            op()

    runs = sorted(_timed_cpu(block, pg) for _ in range(blocks))
    wall, used = runs[len(runs) // 2]  # the median run, and the cores it used
    return wall / n, used


def sweep_sizes(max_bytes: int) -> list[int]:
    sizes, s = [], 1024
    while s <= max_bytes:
        sizes.append(s)
        s *= 4
    return sizes


def measure(pg, rank: int, world: int, *, max_bytes: int, op_budget_s: float, reps: int = 5,
            cores_per_rank: float = 8.0) -> dict:
    lat = [[0.0] * world for _ in range(world)]
    bw = [[0.0] * world for _ in range(world)]
    for a in range(world):
        for b in range(a + 1, world):
            alpha = _pingpong(pg, rank, a, b, PING_BYTES, 21)
            t = _pingpong(pg, rank, a, b, BW_BYTES, reps)
            lat[a][b] = lat[b][a] = alpha
            bw[a][b] = bw[b][a] = BW_BYTES / max(t - alpha, 1e-9)
    sweeps: dict[str, list[list[float]]] = {}
    for name in COLLECTIVES:
        rows = sweeps[name] = []
        for nbytes in sweep_sizes(max_bytes):
            op = _collective(name, pg, world, nbytes)
            first = _timed(op, pg)  # warms the buffers and pairs; also the budget check
            if first > op_budget_s / 4:
                secs, used = _timed_cpu(op, pg)
            else:
                batch = _async_broadcasts(pg, world, nbytes) if name == "broadcast" else None
                secs, used = _back_to_back(op, pg, first, reps, batch=batch)
            rows.append([nbytes, secs, round(cpu_block(used, cores_per_rank), 4)])
            if first > op_budget_s:
                break
    return {"latency_s": lat, "bandwidth_Bps": bw, "sweeps": sweeps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="HOST:PORT of rank 0's store")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--op-budget-s", type=float, default=2.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--ranks-per-host", type=int, default=0, help="ranks sharing this host's cores (default --world)")
    a = ap.parse_args(argv)
    host, port = a.master.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), a.world, is_master=a.rank == 0,
                          timeout=timedelta(seconds=a.timeout_s), wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world,
                            timeout=timedelta(seconds=a.timeout_s))
    try:
        cores = len(os.sched_getaffinity(0)) / (a.ranks_per_host or a.world)
        found = measure(dist.group.WORLD, a.rank, a.world, max_bytes=a.max_bytes, op_budget_s=a.op_budget_s,
                        cores_per_rank=cores)
        if a.rank == 0:
            Topology(world=a.world, label=a.label, **found).save(a.out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
