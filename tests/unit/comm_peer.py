"""Test helper process: one rank of an all-reduce (a pattern, or "shm") over a TCPStore; `--die-after K`
exits after K posts; `--untimed`: the caller waits on gloo's works itself (transport.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from unbroken.comm.group import CollectiveError
from unbroken.comm.patterns import Pattern, allreduce
from unbroken.comm.shm import ShmAllreduce
from unbroken.comm.transport import Transport


class _Dying(Transport):
    """Exits the process (no goodbye) once it has posted `left` transfers: a peer dying mid-collective."""

    def __init__(self, *a, left: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.left = left

    def _post(self, kind, t, peer, tag, *rest):
        x = super()._post(kind, t, peer, tag, *rest)
        self.left -= 1
        if self.left <= 0:
            os._exit(9)
        return x


class _DyingShm(ShmAllreduce):
    """Exits the process once it has reached `left` meetings (after its rows are written: mid-collective)."""

    def __init__(self, *a, left: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.left = left

    def _meet(self, phase, what):
        self.left -= 1
        if self.left <= 0:
            os._exit(9)
        super()._meet(phase, what)


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port", "--die-after"):
        ap.add_argument(name, type=int, default=0)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--pattern", default="pipelined")
    ap.add_argument("--untimed", action="store_true", help="the caller waits inside gloo (no waiter threads)")
    ap.add_argument("--squeeze", action="store_true", help="every transfer of rank 1 compressed (comm/squeeze.py)")
    a = ap.parse_args()
    store = dist.TCPStore("127.0.0.1", a.port, a.world, a.rank == 0, timedelta(seconds=30))
    pg = dist.ProcessGroupGloo(store, a.rank, a.world, timedelta(seconds=30))
    kw = dict(rank=a.rank, world=a.world, timeout_s=a.timeout)
    tp = _Dying(pg, left=1 << 30, **kw) if a.die_after else Transport(pg, **kw)
    world = a.world
    aggs = (0, 1) if a.pattern == "tree" else ()
    p = None if a.pattern == "shm" else Pattern(kind=a.pattern, order=tuple(range(world)), pieces=8 if a.pattern in ("pipelined", "chain") else 1,
                split=tuple(int(not aggs or r in aggs) for r in range(world)), aggregators=aggs,
                squeeze=(1,) if a.squeeze else ())
    t = torch.ones(4_000_000)
    if a.pattern == "shm":  # the shared-memory all-reduce: --die-after counts its meetings
        shm = dying = _DyingShm(pg, left=1 << 30, **kw)
        run = lambda seq: shm(t)  # noqa: E731
    else:
        dying = tp
        run = lambda seq: allreduce(tp, t, p, seq=seq, timed=not a.untimed)  # noqa: E731
    run(1)  # a warm-up everyone finishes: the links are up
    if a.die_after:
        dying.left = a.die_after  # posts (a pattern's transport) or meetings (shm) left
    t0 = time.monotonic()
    try:
        run(2)
        out = {"rank": a.rank, "raised": None, "correct": bool((t == world ** 2).all())}
    except CollectiveError as e:
        out = {"rank": a.rank, "raised": str(e)[:300]}
    out["after_s"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
