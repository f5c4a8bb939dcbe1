"""One generation's process group, with collectives that never wait forever.

Every collective is issued async and polled: it finishes, fails (a peer died),
runs past its deadline, or is abandoned because the supervisor published a newer
generation. Retiring a group is a fence: when `retire()` returns, every op it issued has
ended and no byte can land in a buffer it was given (or AbandonedOpsStuck is raised).
The group object is never destroyed; `retired` keeps old ones referenced until exit.
With backend "nccl" a second, NCCL group carries the CUDA tensors' collectives; control
traffic (CPU tensors: votes, JSON, flags) stays on gloo. With backend "gloo", CUDA tensors
(ranks sharing a GPU) go through gloo staged in host memory (comm/staged.py). XOR/AND
reductions use gloo's BXOR/BAND where the group has them, else the exchange path of
comm/bitwise.py.
"""
from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from unbroken.comm import bitwise
from unbroken.comm.staged import StagedGroup

BACKENDS = ("gloo", "nccl")
GATHER_STAGING_BYTES = 4 << 20  # the most an all-gather stages at once (see Comm.allgather_into)


class Pending:
    """An issued collective: done when `done` is set; `error` holds its exception, if any."""

    def __init__(self, what: str) -> None:
        self.what, self.done, self.error = what, threading.Event(), []
        self.after: Callable[[], object] | None = None  # run by finish() once the op succeeded


class BadControlMessage(ValueError):
    """A peer's control message is not what the protocol allows (e.g. pickle, not JSON)."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the job must move to a new generation."""


class GenerationChanged(CollectiveError):
    """A newer generation was published while we waited."""


class AbandonedOpsStuck(Exception):
    """A retired generation's op did not end within the fence timeout: it may still write
    into a buffer the next generation reuses. Not a CollectiveError (nothing may retry it):
    the process must die so that a fresh one takes its place."""


retired: list["Comm"] = []  # groups that may hold hung ops: keep them alive, never destroy


def socket_fds(pid: int | str = "self") -> dict[int, str]:
    """Process `pid`'s socket fds and their links, "socket:[inode]" (Linux /proc; empty elsewhere or
    when the process is gone)."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


class Comm:
    """Collectives for `rank` of `world` in generation `gen` over `store` (prefix applied by caller)."""

    def __init__(self, store: dist.Store, *, rank: int, world: int, gen: int, timeout_s: float,
                 interrupted: Callable[[], bool] | None = None, fence_s: float = 5.0,
                 backend: str = "gloo", bitwise_reduce: str = "auto") -> None:
        if fence_s <= 0:
            raise ValueError(f"Comm fence_s must be > 0 seconds, got {fence_s!r}; e.g. 5.0")
        if backend not in BACKENDS:
            raise ValueError(f"Comm backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if bitwise_reduce not in bitwise.BITWISE_MODES:
            raise ValueError(f"Comm bitwise_reduce must be one of {', '.join(bitwise.BITWISE_MODES)}, "
                             f"got {bitwise_reduce!r}")
        self.backend, self.bitwise_reduce = backend, bitwise_reduce
        self.dev_pg = None  # the NCCL group for CUDA tensors (backend "nccl")
        self.rank, self.world, self.gen, self.timeout_s, self.fence_s = rank, world, gen, timeout_s, fence_s
        self._interrupted = interrupted or (lambda: False)
        self.waited_s = 0.0  # total time spent inside collectives (straggler evidence)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None
        self._current: Pending | None = None  # the op the waiter thread is waiting on
        self._retired = False
        self._sockets: dict[int, str] = {}  # fd -> "socket:[inode]" opened by our rendezvous
        self.pg = self._rendezvous(store)
        self.staged = StagedGroup(self.pg)  # gloo for device tensors when there is no NCCL group

    def _rendezvous(self, store: dist.Store) -> dist.ProcessGroupGloo:
        """Connect the full mesh in a helper thread, so that a generation superseded while we
        wait (a member died before connecting) releases us at once instead of at the timeout."""
        p, box = Pending(f"rendezvous of generation {self.gen}"), []

        def connect() -> None:
            try:
                before = socket_fds()
                box.append(dist.ProcessGroupGloo(store, self.rank, self.world, timedelta(seconds=self.timeout_s)))
                after = socket_fds()
                self._sockets = {fd: link for fd, link in after.items() if before.get(fd) != link}
                if self.backend == "nccl":
                    self.dev_pg = _nccl_group(store, self.rank, self.world, self.timeout_s)
            except BaseException as e:  # noqa: BLE001 - handed to the caller in finish()
                p.error.append(e)
            finally:
                p.done.set()

        threading.Thread(target=connect, name=p.what, daemon=True).start()
        self.finish(p)
        return box[0]

    def retire(self, fence_s: float | None = None) -> None:
        """This generation is over. A fence: on return every op this group issued has ended
        (failed or succeeded) and no further byte can land in a buffer it was given, so the
        next generation may reuse them (flat.grads, flat.params, tier-1 receive buffers).

        1. Its connected sockets are shut down (drop_links: syscalls, synchronous): gloo
           sees "connection closed" and fails every op still waiting on a peer, exactly as
           when a peer dies; a late sender's bytes now have nowhere to go.
        2. The waiter thread is handed a sentinel behind every queued op; we wait for it,
           at most `fence_s` (default: the constructor's). Past that an op is stuck in
           native code and may still write: AbandonedOpsStuck (the process must die).

        `pg.shutdown()` runs on a helper thread (it may block). The object stays referenced
        (`retired`), never destroyed: gloo's threads may still touch it. Shutting the sockets
        also stops gloo's event loop spinning on a dead generation's unread bytes (it burnt
        ~45% of a core for the rest of the run; pg.shutdown() alone did not stop it). The
        fds stay open (gloo owns them), so no number is ever reused under it.
        """
        if self._retired:
            return
        self._retired = True
        retired.append(self)
        self.drop_links()
        threading.Thread(target=self._shutdown, name=f"unbroken-shutdown-gen{self.gen}", daemon=True).start()
        self._fence(self.fence_s if fence_s is None else fence_s)

    def _fence(self, timeout_s: float) -> None:
        """Wait until the waiter thread has finished every op queued before now; then let it end."""
        if self._waiter is None:
            return  # no op was ever issued
        fence = Pending(f"retirement fence of generation {self.gen}")
        self._queue.put(([], fence))
        self._queue.put(None)  # the waiter thread exits after the fence
        if not fence.done.wait(timeout_s):
            stuck = self._current
            raise AbandonedOpsStuck(
                f"generation {self.gen} (rank {self.rank}/{self.world}) retired, but "
                f"{stuck.what if stuck else 'an issued op'} did not end within {timeout_s:.1f}s of its "
                "sockets being shut down: it may still write into a buffer the next generation reuses")

    def _shutdown(self) -> None:
        # NCCL first: abort() ends its ops stuck on a dead peer, which the fence waits for
        for pg in (self.dev_pg, self.pg):
            try:
                if pg is self.dev_pg and pg is not None:
                    pg.abort()
                elif pg is not None:
                    pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort: a group that cannot shut down is left alone
                pass

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
        if self._retired:  # its waiter thread is gone: nothing would ever finish the op
            raise CollectiveError(f"{what}: generation {self.gen} is retired; its group takes no more ops")
        p = Pending(what)
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_loop, name=f"unbroken-wait-gen{self.gen}", daemon=True)
            self._waiter.start()
        self._queue.put((work if isinstance(work, list) else [work], p))
        return p

    def _wait_loop(self) -> None:
        while (item := self._queue.get()) is not None:  # None: retired, every op before it ended
            works, p = item
            self._current = p
            try:
                for w in works:
                    w.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the caller in finish()
                p.error.append(e)
            finally:
                self._current = None
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
        if p.after is not None:
            p.after()

    def _wait(self, work: dist.Work, what: str) -> None:
        self.finish(self.start(work, what))

    # --- collectives ---------------------------------------------------------------
    def _pg(self, t: torch.Tensor):
        """The group a tensor's collective runs on: for CUDA tensors NCCL when there is one, else
        gloo staged through host memory; gloo for host tensors."""
        if not t.is_cuda:
            return self.pg
        return self.dev_pg if self.dev_pg is not None else self.staged

    def _issue(self, t: torch.Tensor, op: Callable[[dist.ProcessGroup], dist.Work], what: str) -> dist.Work:
        """Issue one op. gloo's send/recv touch the socket at once: on a link already closed
        (a dead peer, a retired generation) they raise there, not in wait(). Either way it
        is a failed collective, never a bare RuntimeError escaping recovery."""
        if self._retired:
            raise CollectiveError(f"{what}: generation {self.gen} is retired; its group takes no more ops")
        pg = self._pg(t)
        try:
            work = op(pg)
            return _DeviceAware(work) if pg is self.dev_pg else work
        except RuntimeError as e:
            raise CollectiveError(f"{what} failed at issue in generation {self.gen}: "
                                  f"{str(e).splitlines()[0][:200]}") from e

    def allreduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, what: str = "allreduce") -> None:
        self.finish(self.allreduce_start(t, op, what))

    def allreduce_start(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                        what: str = "allreduce") -> "Pending":
        """Issue an all-reduce and return at once; `finish()` it later (ops complete in issue order)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self.start(self._issue(t, lambda pg: pg.allreduce([t], opts), what), what)

    def alltoall_start(self, out: torch.Tensor, inp: torch.Tensor, what: str = "all-to-all") -> "Pending":
        """inp[s] goes to rank s, out[m] comes from rank m (first dimension = world); one op."""
        opts = dist.AllToAllOptions()
        return self.start(self._issue(inp, lambda pg: pg.alltoall_base(out, inp, [], [], opts), what), what)

    def send_start(self, t: torch.Tensor, dst: int, tag: int, what: str = "send") -> "Pending":
        """Point-to-point send of a contiguous tensor; `finish()` it later."""
        return self.start(self._issue(t, lambda pg: pg.send([t], dst, tag), what), what)

    def recv_start(self, t: torch.Tensor, src: int, tag: int, what: str = "recv") -> "Pending":
        """Point-to-point receive into a contiguous tensor; `finish()` it later."""
        return self.start(self._issue(t, lambda pg: pg.recv([t], src, tag), what), what)

    def broadcast(self, t: torch.Tensor, src: int, what: str = "broadcast") -> None:
        self.finish(self.broadcast_start([(t, src)], what))

    def broadcast_start(self, pieces: list[tuple[torch.Tensor, int]], what: str = "broadcast") -> "Pending":
        """Issue one broadcast per (tensor, source rank) and return at once; `finish()` them later
        as one (zero3's per-unit parameter gathers: each piece comes from the rank that owns it)."""
        works = []
        for t, src in pieces:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            works.append(self._issue(t, lambda pg, t=t, opts=opts: pg.broadcast([t], opts), what))
        return self.start(works, what)

    def reduce(self, t: torch.Tensor, dst: int, op: dist.ReduceOp, what: str = "reduce") -> None:
        self.finish(self.reduce_start(t, dst, op, what))

    def reduce_start(self, t: torch.Tensor, dst: int, op: dist.ReduceOp, what: str = "reduce") -> "Pending":
        opts = dist.ReduceOptions()
        opts.reduceOp, opts.rootRank, opts.rootTensor = op, dst, 0
        return self.start(self._issue(t, lambda pg: pg.reduce([t], opts), what), what)

    def gather_start(self, rows: torch.Tensor | None, mine: torch.Tensor, dst: int, what: str = "gather") -> "Pending":
        """Every rank's `mine` lands in row r of `rows` (world, *mine.shape) on `dst` (None elsewhere)."""
        opts = dist.GatherOptions()
        opts.rootRank = dst
        outs = [[rows[r] for r in range(self.world)]] if rows is not None else []
        return self.start(self._issue(mine, lambda pg: pg.gather(outs, [mine], opts), what), what)

    # --- XOR / AND: the backend's bitwise reduce ops, or the exchange path (comm/bitwise.py) ---
    def on_gloo(self, t: torch.Tensor) -> bool:
        """`t`'s collectives run on gloo (directly or host-staged), not on a device group."""
        return not (t.is_cuda and self.dev_pg is not None)

    def bitwise_path(self, t: torch.Tensor) -> str:
        """How XOR/AND of `t` runs here: "native" (gloo's BXOR/BAND) or "exchange" (NCCL has neither)."""
        return "native" if self.bitwise_reduce == "auto" and self.on_gloo(t) else "exchange"

    def xor_allreduce(self, t: torch.Tensor, what: str = "xor all-reduce") -> None:
        if self.bitwise_path(t) == "native":
            self.allreduce(t, dist.ReduceOp.BXOR, what)
        else:
            bitwise.allreduce(self, t, "xor", what)

    def and_allreduce(self, t: torch.Tensor, what: str = "and all-reduce") -> None:
        if self.bitwise_path(t) == "native":
            self.allreduce(t, dist.ReduceOp.BAND, what)
        else:
            bitwise.allreduce(self, t, "and", what)

    def xor_reduce_start(self, t: torch.Tensor, dst: int, what: str = "xor reduce") -> "Pending":
        """`dst`'s `t` becomes the XOR of every rank's `t` once the op is finished (`finish()`)."""
        if self.bitwise_path(t) == "native":
            return self.reduce_start(t, dst, dist.ReduceOp.BXOR, what)
        return bitwise.reduce_start(self, t, dst, "xor", what)

    def xor_reduce(self, t: torch.Tensor, dst: int, what: str = "xor reduce") -> None:
        self.finish(self.xor_reduce_start(t, dst, what))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, what: str = "reduce-scatter") -> None:
        """Sum `inp` (world * n,) over the ranks; this rank receives its slice (n,) in `out`."""
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._wait(self._issue(inp, lambda pg: pg._reduce_scatter_base(out, inp, opts), what), what)

    def allgather_into(self, out: torch.Tensor, mine: torch.Tensor, what: str = "allgather") -> None:
        """`out` is (world * n,) and `mine` is this rank's (n,) part: a separate tensor, or out's own
        slice (in place). Gathered in pieces: gloo (and NCCL, for outputs that are not one flat
        tensor) stage an all-gather in a temporary of the whole output, so a piece bounds that
        temporary to about GATHER_STAGING_BYTES instead of a model-sized buffer."""
        n = mine.numel()
        piece = max(1, GATHER_STAGING_BYTES // max(1, self.world * mine.element_size()))
        for a in range(0, n, piece):
            b = min(n, a + piece)
            outs = [out[i * n + a:i * n + b] for i in range(self.world)]
            part = mine[a:b]
            self._wait(self._issue(part, lambda pg, outs=outs, part=part: pg.allgather([outs], [part]), what), what)

    def allgather_json(self, obj: object, what: str = "allgather_json") -> list:
        """Small metadata exchange as JSON — never pickle: a peer's bytes must not be able to
        run code here. A peer's slot that is not a JSON document raises BadControlMessage."""
        rows = self.allgather_bytes(json.dumps(obj, separators=(",", ":")).encode(), what)
        return [_parse_json(raw, rank, what) for rank, raw in enumerate(rows)]

    def allgather_bytes(self, data: bytes, what: str = "allgather_bytes", cap: int = 16 << 10) -> list[bytes]:
        """Every rank's `data`. One all-gather of `cap`-byte slots; only when some rank's data
        is bigger does a second round with slots of the largest size follow."""
        header = 8

        def slots(size: int, payload: bytes | None) -> torch.Tensor:
            buf = torch.zeros(header + size, dtype=torch.uint8)
            buf[:header] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            if payload:
                buf[header:header + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            out = torch.zeros((header + size) * self.world, dtype=torch.uint8)
            self.allgather_into(out, buf, what)
            return out.view(self.world, header + size)

        rows = slots(cap, data if len(data) <= cap else None)
        sizes = [int(r[:header].view(torch.int64)) for r in rows]
        if max(sizes) > cap:
            rows = slots(max(sizes), data)
        return [r[header:header + n].numpy().tobytes() for r, n in zip(rows, sizes)]

    def barrier(self, what: str = "barrier") -> None:
        self.allreduce(torch.zeros(1), what=what)


class _DeviceAware:
    """A work of a group that may run on CUDA: NCCL's wait() only orders the caller's stream, so
    the waiter thread polls is_completed() (the kernel has finished: any stream may read)."""

    def __init__(self, work: dist.Work) -> None:
        self.work = work

    def wait(self) -> None:
        while not self.work.is_completed():
            time.sleep(0.0002)
        self.work.wait()  # raises the op's error, if any


def _nccl_group(store: dist.Store, rank: int, world: int, timeout_s: float):
    """The NCCL group for a generation's CUDA tensors, on its own key prefix (communicators are
    created lazily at the first collective; abort() ends them on a dead peer)."""
    if not dist.is_nccl_available():
        raise RuntimeError("backend nccl: this torch build has no NCCL; use --backend gloo or a CUDA build of torch")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world, opts)


def _parse_json(raw: bytes, rank: int, what: str) -> object:
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise BadControlMessage(f"{what}: rank {rank} sent {len(raw)} bytes that are not a JSON document ({e}); "
                              "every rank must run the same unbroken version") from None
