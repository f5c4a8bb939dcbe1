"""Test helper process: one rank of a 2-rank Comm. Rank 1 joins and then stalls (never all-reduces);
rank 0 runs the adaptive all-reduce of a size whose transfers the caller waits for inside gloo
(transport.py), and a newer generation is "published" `--newer-after` seconds in: prints what
the all-reduce raised and after how long."""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from unbroken.comm import adaptive
from unbroken.comm.group import CollectiveError, Comm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--timeout", type=float)
    ap.add_argument("--newer-after", type=float)
    a = ap.parse_args()
    store = dist.TCPStore("127.0.0.1", a.port, 2, a.rank == 0, timedelta(seconds=30))
    comm = Comm(store, rank=a.rank, world=2, gen=0, timeout_s=a.timeout)
    comm.barrier("joined")
    t0 = time.monotonic()  # both ranks joined: the clock of the "newer generation" starts
    newer = lambda: time.monotonic() - t0 > a.newer_after  # noqa: E731 - the generation watch's answer
    if a.rank == 1:
        time.sleep(a.timeout + 5)  # a stalled peer: its links stay up, it sends nothing
        os._exit(0)
    ours = adaptive.for_comm(comm, "adaptive", interrupted=newer)
    t = torch.ones(1 << 18)  # 1 MB: under learn_bytes, so its transfers are untimed
    t1 = time.monotonic()
    try:
        ours(t)
        out = {"raised": None}
    except CollectiveError as e:
        out = {"raised": type(e).__name__, "error": str(e)[:300]}
    out["after_newer_s"] = time.monotonic() - t0 - a.newer_after
    out["waited_s"] = time.monotonic() - t1
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
