"""The RL job's processes: the coordinator's TCPStore (training-group rendezvous) and N worker
processes, each with a pipe, optionally each in a dedicated CPU slice (`rl.slices`). The pool
started them, so the pool reaps them: `close` asks each to stop, waits, and SIGKILLs what is
left (injected faults are workers SIGKILLing themselves), then removes the slices."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import torch.distributed as dist

from unbroken.rl import worker
from unbroken.rl.slices import CpuSlices

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


class Pool:
    def __init__(self, processes: int, slices: CpuSlices | None = None) -> None:
        self.slices = slices
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        ctx = mp.get_context("spawn")
        self.procs, self.conns = {}, {}
        try:
            for wid in range(processes):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=worker.main, args=(child, wid, "127.0.0.1", self.store.port),
                                name=f"rl-worker-{wid}", daemon=True)
                p.start()
                child.close()
                if slices is not None:
                    slices.add(f"worker-{wid}", p.pid)
                self.procs[wid], self.conns[wid] = p, parent
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return len(self.procs)

    def alive(self, wid: int) -> bool:
        return self.procs[wid].is_alive()

    def call(self, wid: int, msg: tuple, timeout_s: float = START_TIMEOUT_S) -> tuple:
        """Send one command and wait for its reply (used between runs, when nothing is in flight;
        what a run that stopped on an error left unread is dropped first)."""
        conn = self.conns[wid]
        while conn.poll(0):
            conn.recv()
        conn.send(msg)
        if not conn.poll(timeout_s):
            raise TimeoutError(f"RL worker {wid} did not answer {msg[0]!r} within {timeout_s:.0f} s")
        return conn.recv()

    def close(self) -> None:
        for wid, conn in self.conns.items():
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs.values():
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=STOP_TIMEOUT_S)
        for conn in self.conns.values():
            conn.close()
        if self.slices is not None:
            self.slices.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
