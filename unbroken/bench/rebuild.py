"""Tier-1 cost at realistic state size: rebuild one lost rank from parity, and the per-step delta update.

`world` processes (or threads, for tests) each hold a `ChunkedState` of ~`nbytes` (parameter
shard + Adam m + v as three float32 tensors) and the `Tier1` parity of a k=world group.
Member `lost` then forgets its state; the survivors' `decode_contribution`s are XOR-reduced
to it and `install_decoded` writes them back, verified bitwise against the original.
Also timed: one full delta update (every window's window all-reduce) vs a gloo all-reduce of
the same bytes.

    python -m unbroken.bench.rebuild --rank R --world 4 --port P --nbytes N --out rR.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from unbroken.comm.group import Comm
from unbroken.fsutil import atomic_write_json
from unbroken.protect.chunks import ChunkedState
from unbroken.protect.tier1 import PIPELINE, ParityLayout, Tier1
from unbroken.protect.txn import TxnLog

N_TENSORS = 3  # parameter shard, Adam m, Adam v


def state_layout(nbytes: int, k: int, chunk_kb: int = 256) -> tuple[int, int]:
    """(elements per tensor, elements per chunk) so that 3 float32 tensors hold ~nbytes (never less).

    The chunk count is a multiple of k-1 (whole parity windows) and a chunk is ~chunk_kb
    packed, as in the training job; elements per chunk are a multiple of 16.
    """
    if nbytes < 1 or k < 2 or chunk_kb < 1:
        raise ValueError(f"need nbytes >= 1, k >= 2 and chunk_kb >= 1, got {nbytes}, {k}, {chunk_kb}")
    target = nbytes / (N_TENSORS * 4)
    per_chunk = max(16, chunk_kb * 1024 // (N_TENSORS * 4))
    n_chunks = max(k - 1, round(target / per_chunk / (k - 1)) * (k - 1))
    chunk_elems = math.ceil(target / n_chunks / 16) * 16
    return n_chunks * chunk_elems, chunk_elems


def rebuild_rank(store: dist.Store, *, rank: int, world: int, nbytes: int, lost: int, repeats: int,
                 timeout_s: float = 120.0) -> dict:
    """One member's side of the benchmark; returns its timings (seconds)."""
    comm = Comm(dist.PrefixStore("x/", store), rank=rank, world=world, gen=0, timeout_s=timeout_s)
    n, e = state_layout(nbytes, world)
    gen = torch.Generator().manual_seed(1000 + rank)
    tensors = [torch.randn(n, generator=gen) for _ in range(N_TENSORS)]
    state = ChunkedState(tensors, e, trailer_words=world)  # tier 1 keeps k CRC words per chunk
    layout = ParityLayout(world, state.n_chunks)
    snap = ChunkedState([t.clone() for t in tensors], e, trailer_words=world)  # the parity point's state
    t1 = Tier1(state, layout, rank, TxnLog(state.n_chunks, layout.n_windows), snap)
    comm.barrier(what="start")
    out: dict = {"rank": rank, "bytes_protected": t1.bytes_protected, "parity_bytes": t1.parity_bytes,
                 "n_windows": layout.n_windows,
                 "build_s": t1.build(comm, 0), "rebuild": [], "verified": None}
    out["rebuild"], out["verified"] = _time_rebuild(comm, t1, lost=lost, repeats=repeats)
    out["delta_update_s"] = _time_delta_update(comm, t1, repeats)
    out["allreduce_s"] = _time_allreduce(comm, t1.bytes_protected, repeats)
    comm.barrier(what="end")
    return out


def _time_rebuild(comm: Comm, t1: Tier1, *, lost: int, repeats: int) -> tuple[list[dict], bool | None]:
    lay, state, me = t1.layout, t1.state, comm.rank
    versions = [[0] * lay.n_windows for _ in range(lay.k)]  # parity built at version 0, nothing updated since
    original = [t.clone() for t in state.words] if me == lost else None
    runs, verified = [], (True if me == lost else None)
    for _ in range(repeats):
        if me == lost:
            for t in state.tensors:
                t.zero_()  # a fresh shadow: right shapes, no contents
        comm.barrier(what="rebuild start")
        t0 = time.perf_counter()
        if me == lost:
            buf = torch.zeros((lay.n_windows, lay.k - 1, *state.chunk_shape), dtype=torch.int32)
        else:
            buf = t1.decode_contribution(lost, versions)
        t_decode = time.perf_counter()
        comm.xor_reduce(buf, dst=lost, what=f"decode of member {lost}")
        t_reduce = time.perf_counter()
        if me == lost:
            t1.install_decoded(buf, versions)
            verified = verified and all(torch.equal(a, b) for a, b in zip(original, state.words))
        t_end = time.perf_counter()
        runs.append({"total_s": t_end - t0, "decode_s": t_decode - t0, "reduce_s": t_reduce - t_decode,
                     "install_s": t_end - t_reduce})
    return runs, verified


def _time_delta_update(comm: Comm, t1: Tier1, repeats: int) -> dict[str, list[float]]:
    """One step's worth of parity maintenance: stage each chunk's delta (+CRC), one collective per window.

    Returns per-repeat totals and the part of each spent staging (local compute) vs in collectives.
    """
    lay, me = t1.layout, t1.member
    out: dict[str, list[float]] = {"total": [], "stage": [], "comm": []}
    for _ in range(repeats):
        comm.barrier(what="delta start")
        stage = coll = 0.0
        t0 = time.perf_counter()
        inflight: list = []
        for w in range(lay.n_windows + PIPELINE):
            b = time.perf_counter()
            if inflight and (len(inflight) == PIPELINE or w >= lay.n_windows):
                ow, pending = inflight.pop(0)
                t1.finish_window(comm, pending, ow, 1)
            a = time.perf_counter()
            coll += a - b
            if w >= lay.n_windows:
                continue
            for holder, c in zip(lay.holders(me), lay.window_chunks(me, w)):
                t1.stage_delta(w, holder, c)
            b = time.perf_counter()
            inflight.append((w, t1.start_window(comm, w)))
            stage, coll = stage + b - a, coll + time.perf_counter() - b
        out["total"].append(time.perf_counter() - t0)
        out["stage"].append(stage)
        out["comm"].append(coll)
    return out


def _time_allreduce(comm: Comm, nbytes: int, repeats: int) -> list[float]:
    t = torch.ones(nbytes // 4)
    times = []
    for _ in range(repeats):
        comm.barrier(what="allreduce start")
        t0 = time.perf_counter()
        comm.allreduce(t, what="allreduce of the protected bytes")
        times.append(time.perf_counter() - t0)
    return times


def _slowest(per_rank: list[dict], get) -> list[float]:
    """Per repeat, the slowest member's time (a collective step ends when its last member does)."""
    n = min(len(r["allreduce_s"]) for r in per_rank)
    return [max(get(r, j) for r in per_rank) for j in range(n)]


def aggregate(per_rank: list[dict], *, lost: int) -> dict:
    """Combine the members' timings: rebuild as seen by the lost member, collectives by the slowest."""
    by_rank = {r["rank"]: r for r in per_rank}
    me = by_rank[lost]
    totals = [x["total_s"] for x in me["rebuild"]]
    i = totals.index(statistics.median_low(totals))
    survivors = [r for r in per_rank if r["rank"] != lost]
    delta, stage, coll = (_slowest(per_rank, lambda r, j, key=key: r["delta_update_s"][key][j])
                          for key in ("total", "stage", "comm"))
    allreduce = _slowest(per_rank, lambda r, j: r["allreduce_s"][j])
    rebuild_s = totals[i]
    return {
        "world": len(per_rank), "lost_member": lost,
        "bytes_protected": me["bytes_protected"], "parity_bytes": me["parity_bytes"],
        "memory_overhead": me["parity_bytes"] / me["bytes_protected"],
        "build_s": max(r["build_s"] for r in per_rank),
        "rebuild_s": rebuild_s, "rebuild_gbps": me["bytes_protected"] / rebuild_s / 1e9,
        "rebuild_phases": {"decode_s": max(r["rebuild"][i]["decode_s"] for r in survivors),
                           "reduce_s": me["rebuild"][i]["reduce_s"], "install_s": me["rebuild"][i]["install_s"]},
        "rebuild_all_s": totals, "verified_bitwise": bool(me["verified"]),
        "delta_update_s": statistics.median(delta), "delta_stage_s": statistics.median(stage),
        "delta_collectives_s": statistics.median(coll),
        "delta_windows": me["n_windows"], "allreduce_same_bytes_s": statistics.median(allreduce),
        "delta_vs_allreduce": statistics.median(delta) / statistics.median(allreduce),
    }


def run_threads(*, nbytes: int, world: int = 4, lost: int = 2, repeats: int = 1) -> dict:
    """All members as threads of this process (tests: small nbytes, no start-up cost)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    results: list[dict] = [None] * world  # type: ignore[list-item]
    errors: list[BaseException] = []

    def member(r: int) -> None:
        try:
            # One client per member: a store connection serves one blocking wait at a time.
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=60))
            results[r] = rebuild_rank(client, rank=r, world=world, nbytes=nbytes, lost=lost, repeats=repeats,
                                      timeout_s=60)
        except BaseException as e:  # noqa: BLE001 - re-raised below in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"rebuild members failed: {errors[:1] or 'a member did not finish in 120 s'}")
    return aggregate(results, lost=lost)


def run_processes(*, nbytes: int, world: int = 4, lost: int = 2, repeats: int = 3, timeout_s: float = 300) -> dict:
    """All members as separate processes (the benchmark): this process hosts the store and reaps them."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-rebuild-") as tmp:
        procs = []
        try:
            for r in range(world):
                cmd = [sys.executable, "-m", "unbroken.bench.rebuild", "--rank", str(r), "--world", str(world),
                       "--port", str(store.port), "--nbytes", str(nbytes), "--lost", str(lost),
                       "--repeats", str(repeats), "--out", str(Path(tmp) / f"r{r}.json")]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            deadline = time.monotonic() + timeout_s
            for p in procs:
                try:
                    _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"rebuild member pid {p.pid} did not finish within {timeout_s:.0f}s") from None
                if p.returncode != 0:
                    raise RuntimeError(f"rebuild member pid {p.pid} exited {p.returncode}: "
                                       f"{err.decode(errors='replace').strip().splitlines()[-1:]}")
            per_rank = [json.loads((Path(tmp) / f"r{r}.json").read_text()) for r in range(world)]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return aggregate(per_rank, lost=lost)


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    for name in ("--rank", "--world", "--port", "--nbytes", "--lost", "--repeats"):
        ap.add_argument(name, type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", a.port, is_master=False, timeout=timedelta(seconds=120))
    res = rebuild_rank(store, rank=a.rank, world=a.world, nbytes=a.nbytes, lost=a.lost, repeats=a.repeats)
    atomic_write_json(a.out, res)
    # Skip interpreter teardown: gloo groups with pipelined ops abort in their destructors.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    _main()
