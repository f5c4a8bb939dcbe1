"""One generation's gloo process group, with collectives that never wait forever.

Every collective is issued async and polled: it finishes, fails (a peer died),
runs past its deadline, or is abandoned because the supervisor published a newer
generation. The group object is never destroyed while an op may still hang in it;
`retired` keeps old ones referenced until the process exits.
"""
from __future__ import annotations

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


class Comm:
    """Collectives for `rank` of `world` in generation `gen` over `store` (prefix applied by caller)."""

    def __init__(self, store: dist.Store, *, rank: int, world: int, gen: int, timeout_s: float,
                 interrupted: Callable[[], bool] | None = None) -> None:
        self.rank, self.world, self.gen, self.timeout_s = rank, world, gen, timeout_s
        self._interrupted = interrupted or (lambda: False)
        self.waited_s = 0.0  # total time spent inside collectives (straggler evidence)
        self.pg = self._rendezvous(store)

    def _rendezvous(self, store: dist.Store) -> dist.ProcessGroupGloo:
        """Connect the full mesh in a helper thread, so that a generation superseded while we
        wait (a member died before connecting) releases us at once instead of at the timeout."""
        p, box = Pending(f"rendezvous of generation {self.gen}"), []

        def connect() -> None:
            try:
                box.append(dist.ProcessGroupGloo(store, self.rank, self.world, timedelta(seconds=self.timeout_s)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller in finish()
                p.error.append(e)
            finally:
                p.done.set()

        threading.Thread(target=connect, name=p.what, daemon=True).start()
        self.finish(p)
        return box[0]

    def retire(self) -> None:
        retired.append(self)

    # --- waiting -------------------------------------------------------------------
    def start(self, work: dist.Work, what: str) -> "Pending":
        """Hand `work` to a daemon thread that does the blocking wait; finish it later.

        Not every gloo op implements is_completed()/futures (reduce_scatter does not), so a
        thread waits while the caller blocks on an Event it can time out of.
        """
        p = Pending(what)

        def waiter() -> None:
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the caller in finish()
                p.error.append(e)
            finally:
                p.done.set()

        threading.Thread(target=waiter, name=f"unbroken-wait-{what}", daemon=True).start()
        return p

    def finish(self, p: "Pending") -> None:
        """Block until `p` completes: raise CollectiveError on failure, deadline or a newer generation."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        try:
            # Event.wait returns as soon as the op completes; the slice only paces the
            # checks for a newer generation and the deadline.
            while not p.done.wait(0.02):
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

    def broadcast(self, t: torch.Tensor, src: int, what: str = "broadcast") -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._wait(self.pg.broadcast([t], opts), what)

    def reduce(self, t: torch.Tensor, dst: int, op: dist.ReduceOp, what: str = "reduce") -> None:
        opts = dist.ReduceOptions()
        opts.reduceOp, opts.rootRank, opts.rootTensor = op, dst, 0
        self._wait(self.pg.reduce([t], opts), what)

    def allgather_into(self, out: torch.Tensor, mine: torch.Tensor, what: str = "allgather") -> None:
        """`out` is (world * n,) and `mine` is out's slice for this rank (n,)."""
        n = mine.numel()
        outs = [out[i * n:(i + 1) * n] for i in range(self.world)]
        self._wait(self.pg.allgather([outs], [mine]), what)

    def allgather_object(self, obj: object, what: str = "allgather_object") -> list:
        """Small metadata exchange: pickled into a fixed-size byte tensor."""
        import pickle

        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = torch.zeros(self.world, dtype=torch.int64)
        self.allgather_into(sizes, size, what + ":sizes")
        cap = int(sizes.max())
        buf = torch.zeros(cap, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.zeros(cap * self.world, dtype=torch.uint8)
        self.allgather_into(out, buf, what)
        return [pickle.loads(out[i * cap:i * cap + int(sizes[i])].numpy().tobytes()) for i in range(self.world)]

    def barrier(self, what: str = "barrier") -> None:
        self.allreduce(torch.zeros(1), what=what)
