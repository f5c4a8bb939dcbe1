"""Point-to-point transfers on a gloo group, each bounded by a deadline, timed on its own when asked.

gloo's send/recv are async at issue, but a work only reports completion from `wait()`
(`is_completed()` stays False until someone waits). A collective whose flows are read
(`begin(timed=True)`) has one waiter thread per (peer, direction) wait that pair's works in
issue order (gloo keeps a pair's messages in order) and stamp each with the wall-clock time it
ended: a transfer's duration is its own, not the time the caller happened to look. One whose
flows are not read (a paced ring, the static baseline, sizes too small to learn from) is waited
for by the caller itself, in gloo's wait: no thread hand-off per message (on 8 ranks sharing two
cores the static ring's CPU per 64 MB fell from 2.37 to 1.49 s; docs/design.md, stop 49).
Every wait is bounded by the collective's deadline; a dead peer fails the work ("connection
closed") and the caller raises CollectiveError at once.

A newer generation must end any wait within milliseconds (`interrupted`). The waiter threads'
transfers are waited for in 5 ms slices that look at it; a wait inside gloo cannot be sliced (a
work that timed out is finished), so while the caller waits there a watchdog thread looks every
5 ms and, once a newer generation exists, calls `abort` (the group's `drop_links`: the old
generation's group is dead anyway), which fails the wait at once. Without an `abort` every
transfer of a transport with `interrupted` goes through the waiter threads. A ring whose caller
waits inside gloo may walk in C++ (`wait_native`, comm/native_ring.py): one wait, watched alike.

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

# gloo's own timeout, set to what is left of our deadline, can fire a few milliseconds before that
# deadline by our clock (it waits whole milliseconds: "Timed out waiting 998ms" for a 1 s deadline); a
# failure that close to the deadline is the deadline, and says so
GLOO_CLOCK_SLACK_S = 0.05

OnTransfer = Callable[[str, int, int, int, float, float], None]  # kind, peer, tag, nbytes, posted, ended


class Transfer:
    """One posted send or recv: `ended` is stamped when it ended; `error` holds its exception, if any.

    Completion is a lock held from posting until the waiter thread releases it: acquiring it is one
    C call, where a `threading.Event` costs a Condition and a fresh lock per wait (user time per
    message 21 -> 12 us on two ranks over loopback; docs/design.md, stop 45)."""

    __slots__ = ("kind", "peer", "tag", "nbytes", "posted", "ended", "error", "_pending", "work", "wire_bytes")

    def __init__(self, kind: str, peer: int, tag: int, nbytes: int, work, *, timed: bool = True,
                 wire_bytes: Callable[[], int] | None = None) -> None:
        self.kind, self.peer, self.tag, self.nbytes, self.work = kind, peer, tag, nbytes, work
        self.wire_bytes = wire_bytes  # a receive into a larger buffer: the bytes that came, once it ended
        self.posted, self.ended, self.error = time.time(), 0.0, None
        self._pending: threading.Lock | None = None  # None: the caller waits on `work` itself
        if timed:
            self._pending = threading.Lock()
            self._pending.acquire()

    @property
    def timed(self) -> bool:
        return self._pending is not None

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
                 on_transfer: OnTransfer | None = None, interrupted: Callable[[], bool] | None = None,
                 abort: Callable[[], None] | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"Transport timeout_s must be > 0 seconds, got {timeout_s!r}; e.g. 30.0")
        self.pg, self.rank, self.world, self.timeout_s = pg, rank, world, timeout_s
        self.on_transfer = on_transfer
        self._interrupted = interrupted  # a newer generation was published: stop waiting at once
        self._abort = abort  # fails every wait on the group at once (the watchdog calls it)
        self._queues: dict[tuple[str, int], queue.SimpleQueue] = {}
        self._deadline = 0.0  # monotonic; set by begin()
        self._timed = True  # this collective's transfers go through the waiter threads (begin)
        self._watchdog: _Watchdog | None = None
        self.broken: str | None = None  # set once a transfer failed: the group is unusable
        self._scratch: dict[int, torch.Tensor] = {}  # slot -> bytes kept for the next collectives

    def begin(self, *, timed: bool = True) -> None:
        """Start a collective: its every wait ends by now + timeout_s. `timed`: its transfers are
        stamped with their own end times (the flows will be read); otherwise the caller waits."""
        if self.broken:
            raise CollectiveError(f"rank {self.rank}: this group already failed ({self.broken}); "
                                  "a new generation's group is needed")
        self._deadline = time.monotonic() + self.timeout_s
        self._timed = timed or (self._interrupted is not None and self._abort is None)
        if not self._timed and self._interrupted is not None:
            if self._watchdog is None:
                self._watchdog = _Watchdog(self._interrupted, self._abort)
            self._watchdog.arm()

    @property
    def caller_waits(self) -> bool:
        """This collective's transfers are waited for by the caller, inside gloo (begin(timed=False))."""
        return not self._timed

    def wait_native(self, run: Callable[[float], None], what: str) -> None:
        """Run `run(seconds left)`, a compiled walk that posts and waits inside gloo with the GIL
        released (comm/native_ring.py), as one untimed wait: bounded by the deadline, failed by the
        watchdog's abort once a newer generation exists. Its RuntimeError ("outcome|send or
        recv|peer|step|gloo's words", ring_walk.cpp) becomes CollectiveError or GenerationChanged."""
        x = Transfer("send", -1, 0, 0, None, timed=False)
        self._inside_gloo(x, what, run)
        if x.error is not None:
            _, kind, peer, step, words = (str(x.error).split("|", 4) + ["", "", "", "", ""])[:5]
            x.kind, x.peer = kind or "send", int(peer) if peer.isdigit() else -1
            x.error = RuntimeError(words or str(x.error))
            self._raise_for(f"{what} ({step})", x)

    def scratch(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`numel` elements of `dtype` to receive into, the same memory at every collective (`slot`:
        which of a collective's buffers). Fresh memory costs the kernel a page fault and a zeroed
        page per 4 KiB each time (64 MB on 8 ranks: 56 MB of raw rows per rank and collective). A
        slot grows to the largest size asked and stays: (N-1)/N of the largest tensor reduced. A
        Transport runs one collective at a time (begin/end), so no two users share a slot; after a
        failure it is broken (a late receive may still land in a slot, nothing reads it again)."""
        nbytes = numel * dtype.itemsize
        buf = self._scratch.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self._scratch[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes].view(dtype)

    def end(self) -> None:
        """The collective begun last is over (or failed): the watchdog sleeps until the next."""
        if self._watchdog is not None:
            self._watchdog.disarm()

    def send(self, t: torch.Tensor, dst: int, tag: int) -> Transfer:
        return self._post("send", t, dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int, *, wire_bytes: Callable[[], int] | None = None) -> Transfer:
        """Receive into `t`; a message shorter than `t` fills a prefix of it (gloo allows it), and then
        `wire_bytes` says, once it ended, how many bytes came (what the flow statistics count)."""
        return self._post("recv", t, src, tag, wire_bytes)

    def _post(self, kind: str, t: torch.Tensor, peer: int, tag: int,
              wire_bytes: Callable[[], int] | None = None) -> Transfer:
        assert t.is_contiguous() and peer != self.rank, (kind, peer, self.rank)
        raw = t.reshape(-1).view(torch.uint8)  # bytes on the wire: every dtype travels alike
        try:
            work = self.pg.send([raw], peer, tag) if kind == "send" else self.pg.recv([raw], peer, tag)
        except RuntimeError as e:  # a closed link fails at issue
            self.broken = f"{kind} with rank {peer}: {str(e).splitlines()[0][:160]}"
            raise CollectiveError(f"rank {self.rank}: {self.broken}") from e
        x = Transfer(kind, peer, tag, t.numel() * t.element_size(), work, timed=self._timed, wire_bytes=wire_bytes)
        if self._timed:
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
        if self._watchdog is not None:
            self._watchdog.stop()

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
            if not x.timed:
                self._wait_work(x, what)
                continue
            while not x.wait_done(min(self._deadline - time.monotonic(), pace)):
                if self._interrupted is not None:
                    self._changed(what, x)
                if time.monotonic() >= self._deadline:
                    self._fail(what, x)
            if x.error is not None:
                self._fail(what, x)
            if self.on_transfer is not None and x.nbytes:
                nbytes = x.wire_bytes() if x.wire_bytes is not None else x.nbytes
                self.on_transfer(x.kind, x.peer, x.tag, nbytes, x.posted, x.ended)

    def _wait_work(self, x: Transfer, what: str) -> None:
        """Wait on an untimed transfer's gloo work here, bounded by the deadline; a newer generation
        fails it through the watchdog's `abort`."""
        if x.work is not None:
            self._inside_gloo(x, what, lambda left: x.work.wait(timedelta(seconds=left)))
            x.ended, x.work = time.time(), None
        if x.error is not None:
            self._raise_for(what, x)

    def _inside_gloo(self, x: Transfer, what: str, block: Callable[[float], object]) -> None:
        """`block(seconds left)` waits inside gloo (the watchdog may abort it: `blocked`); its
        RuntimeError (gloo's failures, its timeout) is kept in `x.error`."""
        if self._watchdog is not None:
            self._changed(what, x)
            self._watchdog.blocked = True
        try:
            block(max(0.001, self._deadline - time.monotonic()))
        except RuntimeError as e:
            x.error = e
        finally:
            if self._watchdog is not None:
                self._watchdog.blocked = False

    def _raise_for(self, what: str, x: Transfer) -> None:
        """`x` failed: GenerationChanged if a newer generation caused it, else CollectiveError."""
        if self._interrupted is not None:
            self._changed(what, x)
        self._fail(what, x)

    def _fail(self, what: str, x: Transfer) -> None:
        """CollectiveError for `x`: its error, or else the deadline passed; the group is broken."""
        if x.error is not None and time.monotonic() < self._deadline - GLOO_CLOCK_SLACK_S:
            self.broken = f"{what}: {x.kind} with rank {x.peer} failed: {str(x.error).splitlines()[0][:160]}"
        else:
            self.broken = f"{what}: {x.kind} with rank {x.peer} did not end within {self.timeout_s:.1f}s"
        raise CollectiveError(f"rank {self.rank}/{self.world}: {self.broken}") from x.error

    def _changed(self, what: str, x: Transfer) -> None:
        """GenerationChanged if a newer generation exists (`interrupted` is set)."""
        if self._interrupted():
            on = f" on rank {x.peer}" if x.peer >= 0 else ""  # a compiled walk names no peer before it fails
            self.broken = f"{what}: a newer generation was published while waiting{on}"
            raise GenerationChanged(f"rank {self.rank}/{self.world}: {self.broken}")


class _Watchdog:
    """While a collective runs (`arm`..`disarm`), every WATCH_S: if the caller is inside gloo's wait
    (`blocked`) and `interrupted()`, call `abort()` (once) so that the wait fails at once. A daemon
    thread, asleep between collectives."""

    WATCH_S = 0.005

    def __init__(self, interrupted: Callable[[], bool], abort: Callable[[], None]) -> None:
        self.interrupted, self.abort = interrupted, abort
        self.blocked = False
        self._armed, self._stopped = threading.Event(), False
        threading.Thread(target=self._run, name="unbroken-p2p-watchdog", daemon=True).start()

    def arm(self) -> None:
        self._armed.set()

    def disarm(self) -> None:
        self._armed.clear()

    def _run(self) -> None:
        while self._armed.wait() and not self._stopped:
            time.sleep(self.WATCH_S)
            if self.blocked and self.interrupted():
                self.abort()
                return

    def stop(self) -> None:
        self._stopped = True
        self._armed.set()
