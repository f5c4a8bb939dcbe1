"""The supervisor's reads of the job's store, one request per tick on etcd.

On the replicated store every call is an HTTP request through etcd's JSON gateway: a tick of
the supervisor loop made about ten (abort, fatal, progress, done, leases, each standby's
assign/ready, ...). `TickReads` wraps the store: `prefetch(keys)` reads the keys a tick looks at
in one request (`EtcdStore.read_many`) and, until `drop()`, `check`/`get`/`add(key, 0)` of those
keys are answered from that snapshot; a write goes to the store and forgets the key's snapshot.
A store without `read_many` (TCPStore: a cheap local round trip per call) is passed through.
`tick_keys(sup)` names the keys of one tick of a Supervisor; a key a tick read that the list
lacks (a new reader, a list that drifted) is learned: the next ticks' prefetch takes it in, until
it has gone unread for `REMEMBER_TICKS` ticks, and `missed` counts the reads that went to the store.
"""
from __future__ import annotations

from unbroken.runtime import failover

REMEMBER_TICKS = 8  # a learned key stays in the prefetch this many ticks after its last read


class TickReads:
    def __init__(self, store) -> None:
        self.store = store
        self.batched = hasattr(store, "read_many")
        self._snap: dict[str, bytes | None] | None = None
        self._learned: dict[str, int] = {}  # key read outside the list -> the tick it was last read
        self._tick = 0
        self._written: set[str] = set()  # keys this tick wrote: read from the store again, as they should
        self.missed = 0  # reads inside a tick that its prefetch did not cover (each a request)

    def prefetch(self, keys: list[str]) -> None:
        if self.batched:
            self._tick += 1
            self._learned = {k: t for k, t in self._learned.items() if self._tick - t <= REMEMBER_TICKS}
            keys = list(dict.fromkeys([*keys, *self._learned]))
            self._snap = dict(zip(keys, self.store.read_many(keys)))
            self._written = set()

    def drop(self) -> None:
        self._snap = None

    def _known(self, keys) -> bool:
        """All of `keys` are answered by this tick's snapshot. A key neither prefetched nor written
        this tick is learned (and counted in `missed`); a learned key read again stays learned."""
        if self._snap is None:
            return False
        unknown = [k for k in keys if k not in self._snap and k not in self._written]
        self.missed += len(unknown)
        for k in keys:
            if k in unknown or k in self._learned:
                self._learned[k] = self._tick
        return all(k in self._snap for k in keys)

    def check(self, keys: list[str]) -> bool:
        if self._known(keys):
            return all(self._snap[k] is not None for k in keys)
        return self.store.check(keys)

    def get(self, key: str) -> bytes:
        if self._known([key]) and self._snap[key] is not None:
            return self._snap[key]
        return self.store.get(key)  # missing: the store's get waits for it

    def add(self, key: str, amount: int) -> int:
        if amount == 0 and self._known([key]):
            return int(self._snap[key] or 0)
        self._forget(key)
        return self.store.add(key, amount)

    def set(self, key: str, value) -> None:
        self._forget(key)
        self.store.set(key, value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        self._forget(key)
        return self.store.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        self._forget(key)
        return self.store.delete_key(key)

    def _forget(self, key: str) -> None:
        if self._snap is not None:
            self._snap.pop(key, None)
            self._written.add(key)

    def __getattr__(self, name: str):  # wait, num_keys, timeouts, ...: the store's own
        return getattr(self.store, name)


def tick_keys(sup) -> list[str]:
    """The store keys one tick of `sup` (a Supervisor) reads, leader's or follower's."""
    keys = ["abort", "fatal", f"excluded/{sup.node}"]
    nodes = range(sup.opts.nnodes)
    if sup.leader:
        keys += ["progress", "faults/n", *(f"done/{r}" for r in range(sup.cfg.world_size))]
        keys += [k for n in nodes for k in (f"lease/{n}", f"excluded/{n}")]
    else:
        keys += ["shutdown", "gen", "lease/quiet", *(f"lease/{n}" for n in nodes)]
    if sup.replicated:
        keys.append(failover.LEADER_KEY)
    if sup.cfg.shadows == "auto":
        keys.append("shadows/size")
    for c in sup.table.children.values():
        if c.role == "shadow" and not c.taken and not c.reaped:
            keys += [f"assign/{c.proc}", f"ready/{c.proc}"]
    return keys
