"""One generation's gloo process group, with collectives that never wait forever.

Every collective is issued async and polled: it finishes, fails (a peer died),
runs past its deadline, or is abandoned because the supervisor published a newer
generation. The group object is never destroyed while an op may still hang in it;
`retired` keeps old ones referenced until the process exits.
"""
from __future__ import annotations

import os
import queue
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist


class Pending:
    """An issued collective: done when `done` is set; `error` holds its exception, if any."""

    def __init__(self, what: str) -> None:
        self.what, self.done, self.error = what, threading.Event(), []


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the job must move to a new generation."""


class GenerationChanged(CollectiveError):
    """A newer generation was published while we waited."""


retired: list["Comm"] = []  # groups that may hold hung ops: keep them alive, never destroy


def _socket_fds() -> dict[int, str]:
    """This process's socket fds and their inodes (Linux /proc; empty elsewhere)."""
    out: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


class Comm:
    """Collectives for `rank` of `world` in generation `gen` over `store` (prefix applied by caller)."""

    def __init__(self, store: dist.Store, *, rank: int, world: int, gen: int, timeout_s: float,
                 interrupted: Callable[[], bool] | None = None) -> None:
        self.rank, self.world, self.gen, self.timeout_s = rank, world, gen, timeout_s
        self._interrupted = interrupted or (lambda: False)
        self.waited_s = 0.0  # total time spent inside collectives (straggler evidence)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None
        self._sockets: dict[int, str] = {}  # fd -> "socket:[inode]" opened by our rendezvous
        self.pg = self._rendezvous(store)

    def _rendezvous(self, store: dist.Store) -> dist.ProcessGroupGloo:
        """Connect the full mesh in a helper thread, so that a generation superseded while we
        wait (a member died before connecting) releases us at once instead of at the timeout."""
        p, box = Pending(f"rendezvous of generation {self.gen}"), []

        def connect() -> None:
            try:
                before = _socket_fds()
                box.append(dist.ProcessGroupGloo(store, self.rank, self.world, timedelta(seconds=self.timeout_s)))
                after = _socket_fds()
                self._sockets = {fd: link for fd, link in after.items() if before.get(fd) != link}
            except BaseException as e:  # noqa: BLE001 - handed to the caller in finish()
                p.error.append(e)
            finally:
                p.done.set()

        threading.Thread(target=connect, name=p.what, daemon=True).start()
        self.finish(p)
        return box[0]

    def retire(self) -> None:
        """This generation is over: shut its group down and keep the object referenced (never
        destroyed) in case a native thread still holds one of its ops.

        gloo's event loop otherwise keeps the dead generation's sockets registered, and an op
        abandoned mid-collective (released by the newer generation, not failed) leaves a
        live peer's bytes unread: epoll_wait then returns at once, forever. That loop thread
        burnt ~45% of a core for the rest of the run (steps ~25% slower after a recovery);
        `pg.shutdown()` alone does not stop it. So the group's own connected sockets (those
        its rendezvous opened) are shut down too: gloo sees "connection closed", fails the
        abandoned op and drops the socket, exactly as when a peer dies. The fds stay open
        (gloo owns them), so no number is ever reused under it. Runs on a helper thread, so
        a group stuck in native code can never block the recovery.
        """
        retired.append(self)
        threading.Thread(target=self._shutdown, name=f"unbroken-shutdown-gen{self.gen}", daemon=True).start()

    def _shutdown(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:  # noqa: BLE001 - best effort: a group that cannot shut down is left alone
            pass
        self.drop_links()

    def drop_links(self) -> None:
        """Shut down this group's connected sockets: to gloo (here and at the peers) it looks
        exactly like a broken link. Used by retire() and by the `linkdrop` fault."""
        for fd, link in self._sockets.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != link:
                    continue  # closed by gloo and the number reused: not ours any more
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                sock.getpeername()  # connected sockets only; a listener is left alone
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                sock.detach()

    # --- waiting -------------------------------------------------------------------
    def start(self, work: dist.Work | list[dist.Work], what: str) -> "Pending":
        """Hand `work` (one op or several) to this group's waiter thread; finish it later.

        Not every gloo op implements is_completed()/futures (reduce_scatter does not), so a
        thread does the blocking waits while the caller blocks on an Event it can time out
        of. One long-lived thread per group, fed by a queue: a group's ops complete in issue
        order, and starting a thread per op cost ~1.5 ms each on a loaded 2-core machine
        (Thread.start() waits until the new thread has been scheduled).
        """
        p = Pending(what)
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_loop, name=f"unbroken-wait-gen{self.gen}", daemon=True)
            self._waiter.start()
        self._queue.put((work if isinstance(work, list) else [work], p))
        return p

    def _wait_loop(self) -> None:
        while True:
            works, p = self._queue.get()
            try:
                for w in works:
                    w.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the caller in finish()
                p.error.append(e)
            finally:
                p.done.set()

    def finish(self, p: "Pending") -> None:
        """Block until `p` completes: raise CollectiveError on failure, deadline or a newer generation."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        try:
            # Event.wait returns as soon as the op completes; the slice only paces the
            # checks for a newer generation (a memory read: see GenerationWatch) and the deadline.
            while not p.done.wait(0.005):
                if self._interrupted():
                    raise GenerationChanged(f"{p.what}: generation {self.gen} superseded while waiting")
                if time.monotonic() > deadline:
                    raise CollectiveError(f"{p.what} in generation {self.gen} (rank {self.rank}/{self.world}) "
                                          f"did not finish within {self.timeout_s:.1f}s")
        finally:
            self.waited_s += time.monotonic() - start
        if p.error:
            raise CollectiveError(f"{p.what} failed in generation {self.gen}: "
                                  f"{str(p.error[0]).splitlines()[0][:200]}") from p.error[0]

    def _wait(self, work: dist.Work, what: str) -> None:
        self.finish(self.start(work, what))

    # --- collectives ---------------------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, what: str = "allreduce") -> None:
        self.finish(self.allreduce_start(t, op, what))

    def allreduce_start(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                        what: str = "allreduce") -> "Pending":
        """Issue an all-reduce and return at once; `finish()` it later (ops complete in issue order)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self.start(self.pg.allreduce([t], opts), what)

    def alltoall_start(self, out: torch.Tensor, inp: torch.Tensor, what: str = "all-to-all") -> "Pending":
        """inp[s] goes to rank s, out[m] comes from rank m (first dimension = world); one op."""
        return self.start(self.pg.alltoall_base(out, inp, [], [], dist.AllToAllOptions()), what)

    def send_start(self, t: torch.Tensor, dst: int, tag: int, what: str = "send") -> "Pending":
        """Point-to-point send of a contiguous tensor; `finish()` it later."""
        return self.start(self.pg.send([t], dst, tag), what)

    def recv_start(self, t: torch.Tensor, src: int, tag: int, what: str = "recv") -> "Pending":
        """Point-to-point receive into a contiguous tensor; `finish()` it later."""
        return self.start(self.pg.recv([t], src, tag), what)

    def broadcast(self, t: torch.Tensor, src: int, what: str = "broadcast") -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._wait(self.pg.broadcast([t], opts), what)

    def reduce(self, t: torch.Tensor, dst: int, op: dist.ReduceOp, what: str = "reduce") -> None:
        self.finish(self.reduce_start(t, dst, op, what))

    def reduce_start(self, t: torch.Tensor, dst: int, op: dist.ReduceOp, what: str = "reduce") -> "Pending":
        opts = dist.ReduceOptions()
        opts.reduceOp, opts.rootRank, opts.rootTensor = op, dst, 0
        return self.start(self.pg.reduce([t], opts), what)

    def allgather_into(self, out: torch.Tensor, mine: torch.Tensor, what: str = "allgather") -> None:
        """`out` is (world * n,) and `mine` is out's slice for this rank (n,)."""
        n = mine.numel()
        outs = [out[i * n:(i + 1) * n] for i in range(self.world)]
        self._wait(self.pg.allgather([outs], [mine]), what)

    def allgather_object(self, obj: object, what: str = "allgather_object", cap: int = 16 << 10) -> list:
        """Small metadata exchange, pickled. One all-gather of `cap`-byte slots; only when some
        rank's object is bigger does a second round with slots of the largest size follow."""
        import pickle

        data = pickle.dumps(obj)
        header = 8

        def slots(size: int, payload: bytes | None) -> torch.Tensor:
            buf = torch.zeros(header + size, dtype=torch.uint8)
            buf[:header] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            if payload is not None:
                buf[header:header + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            out = torch.zeros((header + size) * self.world, dtype=torch.uint8)
            self.allgather_into(out, buf, what)
            return out.view(self.world, header + size)

        rows = slots(cap, data if len(data) <= cap else None)
        sizes = [int(r[:header].view(torch.int64)) for r in rows]
        if max(sizes) > cap:
            rows = slots(max(sizes), data)
        return [pickle.loads(r[header:header + n].numpy().tobytes()) for r, n in zip(rows, sizes)]

    def barrier(self, what: str = "barrier") -> None:
        self.allreduce(torch.zeros(1), what=what)
