"""One rank of `unbroken bench collectives` (run inside its network namespace), and the background traffic.

    python -m unbroken.bench.collectives_job rank --rank R --world N --host ADDR --port P --out FILE ...
    python -m unbroken.bench.collectives_job sink --host ADDR --port P --seconds T
    python -m unbroken.bench.collectives_job source --host ADDR --port P --bytes B --seconds T

A rank times every method on every payload, interleaved round by round (gloo, static,
adaptive, gloo, ...), each on its own gloo group, a barrier before each, after `--warmup-each`
untimed collectives of every method at that size (its first: an adaptive one plans for a new
size); a collective's time is the slowest rank's, its CPU the sum over the ranks of their
processes' user + system time (every thread: gloo's, our waiter threads). Rank 0 writes one JSON
line per collective to --out (the adaptive ones carry the events it said since the one before:
plan changes, congestion flags). Background traffic is one TCP stream between two namespaces,
bounded in bytes and in seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta

METHODS = ("gloo", "static", "adaptive")


def _groups(args) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore(args.host, args.port, args.world, args.rank == 0, timedelta(seconds=60))
    return {name: dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/", store), args.rank, args.world,
                                        timedelta(seconds=args.timeout))
            for name in ("control", *METHODS)}


def _runners(pgs: dict, args) -> tuple[dict, object]:
    from unbroken.comm.adaptive import AdaptiveAllreduce

    kw = dict(rank=args.rank, world=args.world, timeout_s=args.timeout)
    ours = {"static": AdaptiveAllreduce(pgs["static"], mode="static", **kw),
            "adaptive": AdaptiveAllreduce(pgs["adaptive"], mode="adaptive", emit=_Events(), **kw)}

    def gloo(t) -> None:
        if not pgs["gloo"].allreduce([t]).wait(timedelta(seconds=args.timeout)):
            raise RuntimeError("gloo all-reduce timed out")

    run = {"gloo": gloo, "static": ours["static"], "adaptive": ours["adaptive"]}
    return {m: run[m] for m in args.methods.split(",")}, ours["adaptive"]


class _Events:
    """What the adaptive all-reduce says on rank 0 (its `emit`): kept, and carried by the record of
    the collective during which it was said (the bench's JSON keeps why each plan ran)."""

    def __init__(self) -> None:
        self.said: list[dict] = []

    def __call__(self, kind: str, **fields) -> None:
        self.said.append({"kind": kind, **fields})

    def drain(self) -> list[dict]:
        out, self.said = self.said, []
        return out


def _over_ranks(pg, value: float, op: str, timeout: float) -> float:
    """`value` reduced over the ranks by `op` ("MAX" or "SUM")."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = getattr(dist.ReduceOp, op)
    pg.allreduce([t], opts).wait(timedelta(seconds=timeout))
    return float(t[0])


def rank_main(args) -> None:
    import torch

    torch.set_num_threads(1)
    pgs = _groups(args)
    runners, adaptive = _runners(pgs, args)
    control = pgs["control"]
    out = open(args.out, "a") if args.rank == 0 else None
    payloads = [int(x) for x in args.payloads.split(",")]

    def one(method: str, x: torch.Tensor, phase: str, rnd: int) -> None:
        t = x.clone()
        control.allreduce([torch.zeros(1)]).wait(timedelta(seconds=args.timeout))  # barrier
        start, t0, c0 = time.time(), time.perf_counter(), time.process_time()
        runners[method](t)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        secs, cpu = _over_ranks(control, secs, "MAX", args.timeout), _over_ranks(control, cpu, "SUM", args.timeout)
        if out:
            rec = {"phase": phase, "round": rnd, "method": method, "bytes": x.numel() * 4, "seconds": secs,
                   "cpu_s": cpu, "start": start, "sha": _digest(t)}
            if method == "adaptive":
                rec["plan"] = adaptive.history[-1]["plan"]
                rec["estimates"] = adaptive.history[-1].get("estimates")
                rec["sync_s"] = adaptive.history[-1].get("sync_s")
                rec["plan_s"] = adaptive.history[-1].get("plan_s")
                rec["probe"] = adaptive.history[-1].get("probe")
                rec["events"] = adaptive.emit.drain()
            out.write(json.dumps(rec) + "\n")
            out.flush()

    g = torch.Generator().manual_seed(1234 + args.rank)
    warm = torch.randn(max(1, args.warmup_bytes // 4), generator=g)
    for rnd in range(args.warmup):
        for m in runners:
            one(m, warm, "warmup", rnd)
    for nbytes in payloads:
        x = torch.randn(max(1, nbytes // 4), generator=g)
        for k in range(args.warmup_each):  # untimed at this size, as nccl-tests warm up each size: not its first
            for m in runners:
                one(m, x, "warmup", args.warmup + k)
        for rnd in range(args.rounds):
            for m in runners:
                one(m, x, "measure", rnd)
    if out:
        out.close()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads may abort in teardown after everything was written


def _digest(t) -> str:
    import hashlib

    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def sink_main(args) -> None:
    """Accept one connection and discard what it sends, until it closes or `seconds` pass."""
    srv = socket.create_server((args.host, args.port))
    srv.settimeout(args.seconds)
    end = time.monotonic() + args.seconds
    try:
        conn, _ = srv.accept()
    except TimeoutError:
        return
    with conn:
        while (left := end - time.monotonic()) > 0:
            conn.settimeout(left)
            try:
                if not conn.recv(1 << 20):
                    return
            except (TimeoutError, OSError):
                return


def source_main(args) -> None:
    """Send at most `bytes` to the sink, for at most `seconds`, as fast as the link lets it."""
    end, sent, chunk = time.monotonic() + args.seconds, 0, b"\0" * (1 << 20)
    for _ in range(100):  # the sink may not listen yet
        try:
            conn = socket.create_connection((args.host, args.port), timeout=1.0)
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise SystemExit(f"background source: no sink at {args.host}:{args.port}")
    with conn:
        while sent < args.bytes and (left := end - time.monotonic()) > 0:
            conn.settimeout(left)
            try:
                sent += conn.send(chunk[: min(len(chunk), args.bytes - sent)])
            except (TimeoutError, OSError):
                break


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="collectives_job")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rank")
    for name, typ in (("--rank", int), ("--world", int), ("--host", str), ("--port", int), ("--out", str),
                      ("--payloads", str), ("--warmup", int), ("--warmup-each", int)):  # warm-ups: collectives.py's
        r.add_argument(name, type=typ, required=True)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--warmup-bytes", type=int, default=16 << 20)
    r.add_argument("--methods", default=",".join(METHODS))
    r.add_argument("--timeout", type=float, default=120.0)
    for name in ("sink", "source"):
        s = sub.add_parser(name)
        s.add_argument("--host", required=True)
        s.add_argument("--port", type=int, required=True)
        s.add_argument("--seconds", type=float, required=True)
        s.add_argument("--bytes", type=int, default=1 << 40)
    args = ap.parse_args(argv)
    {"rank": rank_main, "sink": sink_main, "source": source_main}[args.cmd](args)


if __name__ == "__main__":
    main()
