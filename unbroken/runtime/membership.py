"""The generation protocol over TCPStore: who is rank r in generation g.

Keys (all JSON values):
  gen                 latest generation number
  gen/{g}             {"members": {rank: proc}, "replaced": [rank], "cause": str}
  assign/{proc}       {"rank": r, "gen": g} for a shadow taken into service
  hb/{proc}           {"t": time, "step": s, "phase": p, "gen": g, "rank": r}  (the node's own heartbeat store, runtime/node_heartbeats.py)
  ready/{proc}        a shadow is built and waiting
  progress            rank 0's {"step", "loss", "tokens_per_s"}
  faults/n, faults/{i} the leader's fault log: supervisors' findings, members' failed collectives
                      (append = `add` then `set`: read it with FaultLogReader, never by index alone)
  shutdown            the run is over; shadows exit
Each generation's gloo group lives under PrefixStore(f"gen{g}/").
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist


class MembershipTimeout(TimeoutError):
    pass


@dataclass(frozen=True)
class Generation:
    gen: int
    members: dict[int, str]
    replaced: tuple[int, ...]
    cause: str

    @property
    def world(self) -> int:
        return len(self.members)


def incident_cause(dead: dict[int, dict[str, Any]]) -> str:
    """A generation's cause: each replaced rank's fault, by rank ("crash@rank2,crash@rank3"), or
    "link" when nobody is replaced (the same members regrouped)."""
    return ",".join(f"{dead[r]['fault']}@rank{r}" for r in sorted(dead)) or "link"


def listen_store(host: str, port: int, *, timeout_s: float) -> tuple[dist.TCPStore, socket.socket]:
    """Host the job's store, listening on exactly `host` (TCPStore alone binds every interface).

    We bind the socket ourselves and hand TCPStore its descriptor; the socket is returned so
    the caller keeps it open as long as the store. OSError if the address is taken or not ours.
    """
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(1024)
        store = dist.TCPStore(host, sock.getsockname()[1], is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False, use_libuv=True, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    return store, sock


def connect_store(host: str, port: int, *, timeout_s: float) -> dist.Store:
    """A client connection to the job's store: the etcd cluster the supervisor names in
    UNBROKEN_STORE (runtime/etcd_store.py), else node 0's TCPStore at host:port."""
    if url := os.environ.get("UNBROKEN_STORE"):
        from unbroken.runtime.etcd_store import EtcdStore

        return EtcdStore(url, timeout_s=timeout_s)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False, use_libuv=True)


def put(store: dist.Store, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))


def get(store: dist.Store, key: str, default: Any = None) -> Any:
    if not store.check([key]):
        return default
    return json.loads(store.get(key))


def wait_key(store: dist.Store, key: str, timeout_s: float, who: str) -> Any:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError as e:  # the store raises DistStoreError (a RuntimeError) on timeout
        raise MembershipTimeout(f"waited {timeout_s:.1f}s for {who} (store key {key!r}): {e}") from None
    return json.loads(store.get(key))


def publish(store: dist.Store, gen: Generation) -> None:
    """Supervisor side: the generation record first, then the pointer to it."""
    put(store, f"gen/{gen.gen}", {"members": {str(r): p for r, p in gen.members.items()},
                                  "replaced": list(gen.replaced), "cause": gen.cause})
    store.set("gen", str(gen.gen))


def read_generation(store: dist.Store, g: int, timeout_s: float) -> Generation:
    d = wait_key(store, f"gen/{g}", timeout_s, f"generation {g} to be published by the supervisor")
    return Generation(g, {int(r): p for r, p in d["members"].items()}, tuple(d["replaced"]), d["cause"])


def latest_gen(store: dist.Store) -> int:
    return int(store.get("gen")) if store.check(["gen"]) else -1


class GenerationWatch:
    """Learns of each new generation the moment it is published, without polling.

    A daemon thread blocks in `store.wait` on the next generation's key over its own store
    connection (a TCPStore client serves one request at a time). `newer_than()` is then a
    memory read, cheap enough for a collective's wait loop to ask every few milliseconds:
    survivors stuck in a collective with a dead peer are released ~as soon as the
    supervisor publishes the replacement generation.
    """

    def __init__(self, connect: Callable[[], dist.Store], *, poll_s: float = 300.0) -> None:
        # poll_s is a safety net only (generations are published in order, none is skipped):
        # each timed-out wait is two c10d warning lines in the rank's log, which --tee shows
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self.latest = -1
        self.error: BaseException | None = None
        # Connect here, not in the thread: a socket opened while a group's rendezvous runs
        # would be taken for one of that group's (Comm records them to close on retirement).
        self._store = connect()
        threading.Thread(target=self._run, name="unbroken-generation-watch", daemon=True).start()

    def _run(self) -> None:
        store = self._store
        try:
            g = latest_gen(store)
            self._set(g)
            while True:
                try:
                    store.wait([f"gen/{g + 1}"], timedelta(seconds=self._poll_s))
                    g += 1
                except RuntimeError:  # timed out (the store raises): re-read, in case a key was skipped
                    g = max(g, latest_gen(store))
                self._set(g)
        except BaseException as e:  # noqa: BLE001 - the store is gone: waiters fall back to their deadlines
            self.error = e

    def _set(self, g: int) -> None:
        with self._cond:
            if g > self.latest:
                self.latest = g
                self._cond.notify_all()

    def newer_than(self, g: int) -> bool:
        return self.latest > g

    def wait_newer(self, than: int, timeout_s: float) -> bool:
        """Block until a generation newer than `than` is known; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.latest > than, timeout=timeout_s)


def wait_newer_generation(store: dist.Store, than: int, timeout_s: float,
                          watch: GenerationWatch | None = None) -> Generation:
    """Block until a generation newer than `than` exists; return the newest."""
    deadline = time.monotonic() + timeout_s
    if watch is not None and watch.error is None:
        watch.wait_newer(than, timeout_s)
    while True:
        g = latest_gen(store)
        if g > than:
            return read_generation(store, g, timeout_s=max(1.0, deadline - time.monotonic()))
        if time.monotonic() > deadline:
            raise MembershipTimeout(f"no generation newer than {than} within {timeout_s:.1f}s; "
                                    "is the supervisor alive?")
        time.sleep(0.002)


def report_fault(store: dist.Store, record: dict[str, Any]) -> None:
    """Append to the leader's fault log (`faults/n`, `faults/{i}`): a supervisor's finding
    about one of its processes, or a member's failed collective (fault `collective_error`).

    Two writes, not atomic: the index is reserved first, the record lands later (or never,
    if the reporter dies in between). FaultLogReader is the reader that survives both."""
    i = store.add(_FAULTS_N, 1) - 1
    put(store, fault_key(i), record)


_FAULTS_N = "faults/n"


def fault_key(i: int) -> str:
    return f"faults/{i}"


class FaultLogReader:
    """The leader's cursor over the fault log: every record exactly once, none lost.

    `take()` returns the records that appeared since the last call, in index order among
    those present. An index already counted in `faults/n` whose record has not landed yet
    (its reporter is between its two writes) stays pending and is retried on every later
    call, so its record is delivered late, never skipped. A record still missing after
    `give_up_s` (the reporter died between the writes) is declared lost, once: its index
    is appended to `lost` and passed to `on_lost(index, waited_s)`; it is not polled again.
    """

    def __init__(self, store: dist.Store, *, give_up_s: float = 10.0,
                 on_lost: Callable[[int, float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if give_up_s <= 0:
            raise ValueError(f"FaultLogReader give_up_s must be > 0 seconds, got {give_up_s!r}; e.g. 10.0")
        self._store, self._give_up_s, self._on_lost, self._clock = store, give_up_s, on_lost, clock
        self._next = 0  # first index not yet counted
        self._pending: dict[int, float] = {}  # index -> when it was first counted without its record
        self.lost: list[int] = []

    @property
    def cursor(self) -> int:
        """The first index not yet delivered: a new leader starts reading there (runtime/failover.py)."""
        return min(self._pending) if self._pending else self._next

    def skip_to(self, index: int) -> None:
        """Start at `index`: the records before it were acted on by the leader this one succeeds."""
        self._next = max(self._next, index)

    @property
    def pending(self) -> list[int]:
        """Indices counted in `faults/n` whose record has not been read yet."""
        return sorted(self._pending)

    def take(self) -> list[dict[str, Any]]:
        """New records, each returned exactly once over this reader's lifetime."""
        return [record for _, record in self.take_indexed()]

    def take_indexed(self) -> list[tuple[int, dict[str, Any]]]:
        """`take`, each record with its index in the log (a leader that holds a record back
        publishes a cursor no later than its index: runtime/lease.py, FaultHold)."""
        n = int(self._store.add(_FAULTS_N, 0))
        now = self._clock()
        for i in range(self._next, n):
            self._pending[i] = now
        self._next = max(self._next, n)
        out = []
        for i in sorted(self._pending):
            record = get(self._store, fault_key(i))
            if record is not None:
                del self._pending[i]
                out.append((i, record))
            elif now - self._pending[i] >= self._give_up_s:
                self._give_up(i, now - self._pending.pop(i))
        return out

    def _give_up(self, i: int, waited_s: float) -> None:
        self.lost.append(i)
        if self._on_lost is not None:
            self._on_lost(i, waited_s)


class FaultLogWatch:
    """Wakes the leader the moment the next fault record lands, instead of polling the log.

    A daemon thread blocks in `store.wait` on the next record's key over its own connection (on
    etcd a watch: no request while nothing happens); `landed()` says, once, that records landed
    since it was last asked, and `on_land()` (from the thread) wakes the leader's loop. A record
    that lands out of order (its reporter between its two writes) is skipped after `poll_s`; the
    leader's slower poll of the log (FaultLogReader) still delivers every record.
    """

    def __init__(self, connect: Callable[[], dist.Store], start: int, on_land: Callable[[], None], *,
                 poll_s: float = 30.0) -> None:
        self._store, self._next, self._on_land, self._poll_s = connect(), start, on_land, poll_s
        self._landed, self._closed = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name="unbroken-fault-watch", daemon=True).start()

    def _run(self) -> None:
        store = self._store
        try:
            while not self._closed.is_set():
                try:
                    store.wait([fault_key(self._next)], timedelta(seconds=self._poll_s))
                except RuntimeError:  # timed out (the store raises): past a record that never landed
                    self._next = max(self._next, int(store.add(_FAULTS_N, 0)) - 1)
                    continue
                self._next += 1
                self._landed.set()
                if not self._closed.is_set():
                    self._on_land()
        except BaseException as e:  # noqa: BLE001 - the store is gone: the leader's poll remains
            self.error = e

    def landed(self) -> bool:
        """True once after each batch of records landed."""
        if not self._landed.is_set():
            return False
        self._landed.clear()
        return True

    def close(self) -> None:
        """Stop waking the leader; the thread ends after its current wait (it is a daemon)."""
        self._closed.set()


def group_store(store: dist.Store, gen: int, name: str = "world") -> dist.Store:
    if hasattr(store, "prefixed"):  # an EtcdStore: PrefixStore cannot wrap a store written in Python
        return store.prefixed(f"gen{gen}/{name}")
    return dist.PrefixStore(f"gen{gen}/{name}/", store)
