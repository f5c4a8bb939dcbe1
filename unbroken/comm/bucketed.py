"""Our all-reduce issued per gradient bucket while backward runs: one communication thread runs
the adaptive (or static, chain, or shared-memory) all-reduce of each bucket in issue order, behind the two calls the
gradient buckets make of a `Comm` (`allreduce_start`, `finish`), so they overlap as gloo's do.

Only that thread touches the AdaptiveAllreduce (its plan, sequence numbers, flow tables): a
whole-gradient call goes through it too. Every rank issues the same buckets in the same order
(parallel/buckets.py), so the collectives' sequence, the flow exchange points and the plans agree
on every rank. The reduction is per element in rank order whatever the cut (comm/patterns.py):
per-bucket results equal the whole-gradient ones bit for bit. After a failure the group is
broken (Transport.broken): every bucket still queued fails at once, none waits its timeout.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from unbroken.comm import adaptive
from unbroken.comm.adaptive import AdaptiveAllreduce, Emit
from unbroken.comm.group import CollectiveError, GenerationChanged, Pending
from unbroken.comm.shm import ShmAllreduce


class BucketedAllreduce:
    """`ours` run on a thread of its own; `comm` (optional) is credited the time spent waiting;
    `interrupted()` True: a newer generation exists, stop waiting at once."""

    def __init__(self, ours: AdaptiveAllreduce | ShmAllreduce, comm=None, interrupted: Callable[[], bool] | None = None) -> None:
        self.ours, self.comm, self._interrupted = ours, comm, interrupted
        self.timeout_s = ours.tp.timeout_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def mode(self) -> str:
        return self.ours.mode

    def __call__(self, t: torch.Tensor, what: str = "all-reduce") -> None:
        """The whole tensor at once, blocking (a redo, or buckets not overlapped)."""
        self.finish(self.allreduce_start(t, what=what))

    def allreduce_start(self, t: torch.Tensor, op=dist.ReduceOp.SUM, what: str = "all-reduce") -> Pending:
        """Queue a sum all-reduce of `t` (contiguous; written in place) and return at once."""
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"--collectives {self.ours.mode} all-reduces sum only, got {op}; use --collectives gloo")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"unbroken-ours-r{self.ours.rank}", daemon=True)
            self._thread.start()
        p = Pending(what)
        self._queue.put((t, p))
        return p

    def finish(self, p: Pending) -> None:
        """Block until `p` ended: CollectiveError on its failure or past the collective timeout after
        the ones queued before it (each of those bounded alike), GenerationChanged as the transport
        raised it."""
        start = time.monotonic()
        deadline = start + self.timeout_s * (1 + self._queue.qsize()) + 1.0
        pace = 0.005 if self._interrupted else 1.0  # how often to look for a newer generation
        try:
            while not p.done.wait(pace):
                if self._interrupted is not None and self._interrupted():
                    raise GenerationChanged(f"{p.what}: a newer generation was published while waiting")
                if time.monotonic() > deadline:
                    raise CollectiveError(f"{p.what} (rank {self.ours.rank}/{self.ours.world}) did not end within "
                                          f"{self.timeout_s:.1f}s of the all-reduces before it")
        finally:
            if self.comm is not None:
                self.comm.waited_s += time.monotonic() - start
        if p.error:
            e = p.error[0]
            raise e if isinstance(e, CollectiveError) else CollectiveError(f"{p.what}: {e}") from e

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            t, p = item
            try:
                self.ours(t, what=p.what)
            except BaseException as e:  # noqa: BLE001 - handed to the caller in finish()
                p.error.append(e if isinstance(e, CollectiveError) else   # GenerationChanged included
                               CollectiveError(f"{p.what}: {type(e).__name__}: {e}"))
            finally:
                p.done.set()

    def close(self, timeout_s: float | None = None) -> None:
        """Retire: the thread ends after what was queued (each fails at once on a broken group) and
        is joined, so that no bucket is written into after this returns (bounded: a wait past the
        transport's deadline cannot happen); then the transport's threads may end."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(self.timeout_s + 5.0 if timeout_s is None else timeout_s)
            self._thread = None
        self.ours.close()


def for_comm(comm, mode: str, *, emit: Emit | None = None,
             interrupted: Callable[[], bool] | None = None) -> BucketedAllreduce | None:
    """The gradient all-reduce of a generation's `Comm` for --collectives `mode` (None for gloo's own)."""
    if mode == "gloo":
        return None
    if comm.dev_pg is not None:
        raise ValueError(f"--collectives {mode} moves CPU tensors over gloo, but this job's gradients are on "
                         "CUDA (NCCL); use --collectives gloo or --backend gloo")
    if mode == "shm":
        ours = ShmAllreduce(comm.pg, rank=comm.rank, world=comm.world, timeout_s=comm.timeout_s,
                            interrupted=interrupted)
    else:
        ours = adaptive.for_comm(comm, mode, emit=emit, interrupted=interrupted)
    return BucketedAllreduce(ours, comm, interrupted)
