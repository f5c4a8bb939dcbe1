"""Point-to-point transfers on a gloo group, each bounded by a deadline and timed on its own.

gloo's send/recv are async at issue, but a work only reports completion from `wait()`
(`is_completed()` stays False until someone waits). So one waiter thread per (peer,
direction) waits that pair's works in issue order (gloo keeps a pair's messages in order)
and stamps each with the wall-clock time it ended: a transfer's duration is its own, not
the time the caller happened to look. Every wait is bounded by the collective's deadline; a
dead peer fails the work ("connection closed") and the caller raises CollectiveError at once.

Each finished transfer is handed to `on_transfer(kind, peer, tag, nbytes, posted,
ended)` (flow
statistics, comm/flows.py); times are `time.time()` so peers' records can be joined.
"""
from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from unbroken.comm.group import CollectiveError, GenerationChanged

OnTransfer = Callable[[str, int, int, int, float, float], None]  # kind, peer, tag, nbytes, posted, ended


class Transfer:
    """One posted send or recv: `ended` is stamped when it ended; `error` holds its exception, if any.

    Completion is a lock held from posting until the waiter thread releases it: acquiring it is one
    C call, where a `threading.Event` costs a Condition and a fresh lock per wait (user time per
    message 21 -> 12 us on two ranks over loopback; docs/design.md, stop 45)."""

    __slots__ = ("kind", "peer", "tag", "nbytes", "posted", "ended", "error", "_pending", "work")

    def __init__(self, kind: str, peer: int, tag: int, nbytes: int, work) -> None:
        self.kind, self.peer, self.tag, self.nbytes, self.work = kind, peer, tag, nbytes, work
        self.posted, self.ended, self.error = time.time(), 0.0, None
        self._pending = threading.Lock()
        self._pending.acquire()

    def finish(self) -> None:
        """Called once, by the waiter thread, after `ended` and `error` are set."""
        self._pending.release()

    def wait_done(self, timeout_s: float) -> bool:
        """True once the transfer ended (at once if it already had), False after `timeout_s`."""
        if not self._pending.acquire(timeout=max(0.0, timeout_s)):
            return False
        self._pending.release()  # ended stays observable to later waits
        return True


class Transport:
    """Sends and receives of `rank` in a gloo group `pg` of `world` ranks; waits end by `timeout_s`."""

    def __init__(self, pg, *, rank: int, world: int, timeout_s: float,
                 on_transfer: OnTransfer | None = None, interrupted: Callable[[], bool] | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"Transport timeout_s must be > 0 seconds, got {timeout_s!r}; e.g. 30.0")
        self.pg, self.rank, self.world, self.timeout_s = pg, rank, world, timeout_s
        self.on_transfer = on_transfer
        self._interrupted = interrupted  # a newer generation was published: stop waiting at once
        self._queues: dict[tuple[str, int], queue.SimpleQueue] = {}
        self._deadline = 0.0  # monotonic; set by begin()
        self.broken: str | None = None  # set once a transfer failed: the group is unusable

    def begin(self) -> None:
        """Start a collective: its every wait ends by now + timeout_s."""
        if self.broken:
            raise CollectiveError(f"rank {self.rank}: this group already failed ({self.broken}); "
                                  "a new generation's group is needed")
        self._deadline = time.monotonic() + self.timeout_s

    def send(self, t: torch.Tensor, dst: int, tag: int) -> Transfer:
        return self._post("send", t, dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int) -> Transfer:
        return self._post("recv", t, src, tag)

    def _post(self, kind: str, t: torch.Tensor, peer: int, tag: int) -> Transfer:
        assert t.is_contiguous() and peer != self.rank, (kind, peer, self.rank)
        raw = t.reshape(-1).view(torch.uint8)  # bytes on the wire: every dtype travels alike
        try:
            work = self.pg.send([raw], peer, tag) if kind == "send" else self.pg.recv([raw], peer, tag)
        except RuntimeError as e:  # a closed link fails at issue
            self.broken = f"{kind} with rank {peer}: {str(e).splitlines()[0][:160]}"
            raise CollectiveError(f"rank {self.rank}: {self.broken}") from e
        x = Transfer(kind, peer, tag, t.numel() * t.element_size(), work)
        self._queue(kind, peer).put(x)
        return x

    def _queue(self, kind: str, peer: int) -> queue.SimpleQueue:
        q = self._queues.get((kind, peer))
        if q is None:
            q = self._queues[(kind, peer)] = queue.SimpleQueue()
            threading.Thread(target=self._wait_loop, args=(q,), daemon=True,
                             name=f"unbroken-p2p-{kind}-{peer}").start()
        return q

    def close(self) -> None:
        """Let the waiter threads end once they have waited for what was posted (a retired group)."""
        for q in self._queues.values():
            q.put(None)
        self._queues = {}

    def _wait_loop(self, q: queue.SimpleQueue) -> None:
        while (x := q.get()) is not None:
            left = max(0.001, self._deadline - time.monotonic())
            try:
                x.work.wait(timedelta(seconds=left))
            except BaseException as e:  # noqa: BLE001 - handed to the caller in wait()
                x.error = e
            x.ended = time.time()
            x.work = None
            x.finish()

    def wait(self, transfers: list[Transfer], what: str) -> None:
        """Block until every transfer ended; CollectiveError on a failure or past the deadline,
        GenerationChanged as soon as `interrupted()` says a newer generation exists."""
        pace = 0.005 if self._interrupted else float("inf")  # how often to look for a newer generation
        for x in transfers:
            while not x.wait_done(min(self._deadline - time.monotonic(), pace)):
                if self._interrupted is not None and self._interrupted():
                    self.broken = f"{what}: a newer generation was published while waiting on rank {x.peer}"
                    raise GenerationChanged(f"rank {self.rank}/{self.world}: {self.broken}")
                if time.monotonic() >= self._deadline:
                    self.broken = f"{what}: {x.kind} with rank {x.peer} did not end within {self.timeout_s:.1f}s"
                    raise CollectiveError(f"rank {self.rank}/{self.world}: {self.broken}")
            if x.error is not None:
                self.broken = f"{what}: {x.kind} with rank {x.peer} failed: {str(x.error).splitlines()[0][:160]}"
                raise CollectiveError(f"rank {self.rank}/{self.world}: {self.broken}") from x.error
            if self.on_transfer is not None and x.nbytes:
                self.on_transfer(x.kind, x.peer, x.tag, x.nbytes, x.posted, x.ended)
