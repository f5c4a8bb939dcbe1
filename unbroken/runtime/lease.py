"""Node leases: the leader's proof that every other node's supervisor is alive.

A supervisor's children are watched by that supervisor; nobody watches the supervisor
itself, so a host that vanishes (its supervisor and children SIGKILLed, power lost) or
freezes (SIGSTOP, a hung kernel) would go unreported. Every supervisor therefore renews
its lease once per loop tick (`renew`: one atomic counter add in the store). The leader
notes, on its own monotonic clock, when each node's counter last moved (no cross-host
clock comparison); a node whose counter has not moved for `lease_s` is lost: the leader
replaces all its ranks at once (one node-loss incident). A link regroup needs proof that
every node renewed after the collective error (`renewed_after`): a dead host must not be
regrouped as though only its link had broken. A fault record from another node waits for that
node's lease to decide (`FaultHold`): a host that dies whole is one node loss, whichever of its
ranks' crash reports and its lease's expiry the leader sees first.
"""
from __future__ import annotations

import time

import torch.distributed as dist


def renew(store: dist.Store, node: int) -> None:
    store.add(f"lease/{node}", 1)


class NodeLeases:
    """The leader's view of the other nodes (`nodes`; default 1..nnodes-1: node 0 leads)."""

    def __init__(self, nnodes: int, lease_s: float, *, nodes: list[int] | None = None, clock=time.monotonic) -> None:
        self.lease_s, self._clock = lease_s, clock
        now = clock()
        self.nodes = list(range(1, nnodes)) if nodes is None else list(nodes)
        self._value = {n: -1 for n in self.nodes}
        self._moved = {n: now for n in self.nodes}
        self.lost: set[int] = set()

    def observe(self, store: dist.Store) -> list[tuple[int, float]]:
        """Read every live node's counter; return (node, age_s) of nodes just found lost."""
        now, out = self._clock(), []
        for node in self._value:
            if node in self.lost:
                continue
            v = store.add(f"lease/{node}", 0)
            if v != self._value[node]:
                self._value[node], self._moved[node] = v, now
            elif now - self._moved[node] > self.lease_s:
                self.lost.add(node)
                out.append((node, now - self._moved[node]))
        return out

    def read(self, store: dist.Store) -> dict[int, int]:
        """Every live node's counter as the store holds it now."""
        return {n: store.add(f"lease/{n}", 0) for n in self._value if n not in self.lost}

    def renewed_after(self, store: dist.Store, before: dict[int, int]) -> bool:
        """Has every live node renewed since `before` (a `read` taken when something happened)?
        Compared as counter values read from the store, not as times the leader happened to
        observe them: a node that renewed just before dying does not pass."""
        now = self.read(store)
        return all(now[n] > before.get(n, -1) for n in now)

    def late(self, seconds: float) -> bool:
        """Has some live node not renewed for more than `seconds`?"""
        return any(self._clock() - self._moved[n] > seconds for n in self._value if n not in self.lost)

    def forget(self, node: int) -> None:
        """An excluded node: its lease no longer matters."""
        self.lost.add(node)


class FaultHold:
    """The leader's fault records from other nodes, each held until that node's lease decides.

    A host that dies whole (supervisor and ranks SIGKILLed at once) may report its ranks' crashes
    in the instant before its supervisor dies (their sockets close first). Acted on at once, they
    would make the node's loss two crashes: the outcome would depend on which the leader saw first.
    So a record from another node is acted on once that node renews its lease after the leader read
    the record (its supervisor outlived the fault: a process fault), or once the node is no longer
    live: lost (`lose_node` replaced its ranks as one incident; the record names a process that is
    no member now) or excluded (its ranks' records move them). The wait ends within the lease:
    a node that does not renew for `lease_s` is lost. Members' failed collectives are never held.
    """

    def __init__(self) -> None:
        self._held: list[tuple[int, dict, int]] = []  # (log index, record, its node's counter when read)

    def __bool__(self) -> bool:
        return bool(self._held)

    def admit(self, taken: list[tuple[int, dict]], leases: NodeLeases | None, store: dist.Store) -> list[dict]:
        """Of the records just `taken` from the fault log ((index, record)) and those held before,
        the ones to act on now, in log order; the others are held."""
        if leases is None or not (self._held or any(_from_live_node(r, leases) for _, r in taken)):
            return [r for _, r in taken]
        counters = leases.read(store)  # live nodes only: a lost or excluded node is absent
        ready, held = [], []
        for i, r, seen in [*self._held, *((i, r, None) for i, r in taken)]:
            node = r.get("node")
            if r["fault"] == "collective_error" or node not in counters:
                ready.append((i, r))  # a member's failed collective; the leader's node; a node lost or excluded
            elif seen is None:
                held.append((i, r, counters[node]))  # just read: wait for the node's next renewal
            elif counters[node] > seen:
                ready.append((i, r))  # renewed since: its supervisor outlived the fault
            else:
                held.append((i, r, seen))
        self._held = held
        return [r for _, r in sorted(ready, key=lambda x: x[0])]

    def cursor(self, reader_cursor: int) -> int:
        """The first record not acted on: a new leader starts reading there (runtime/failover.py)."""
        return min([reader_cursor, *(i for i, _, _ in self._held)])

    def of_node(self, node: int) -> list[str]:
        """The held records of `node`, as fault@proc."""
        return [f"{r['fault']}@{r['proc']}" for _, r, _ in self._held if r.get("node") == node]


def _from_live_node(record: dict, leases: NodeLeases) -> bool:
    """A supervisor's finding from a node whose lease the leader watches and has not found lost."""
    node = record.get("node")
    return record["fault"] != "collective_error" and node in leases.nodes and node not in leases.lost


def lose_node(sup, node: int, age_s: float, ranks: list[int]) -> None:
    """`sup` (the leader's Supervisor) found `node`'s lease expired: record it, fence the node off
    (excluded: if it comes back it stops its processes and leaves), and replace all its `ranks` at once."""
    from unbroken.detect import Finding, classify

    now, ranks = time.time(), sorted(ranks)
    f = Finding(fault="node_lost", proc=f"node{node}", rank=None, node=node, time=now,
                evidence={"why": f"node {node}'s supervisor has not renewed its lease for {age_s:.1f}s "
                                 f"(node_lease_s={sup.cfg.node_lease_s})", "ranks": ranks,
                          "lease_age_s": round(age_s, 3), "reports_held": sup.held.of_node(node)})
    d = classify(f, sup.watch.offenders, can_exclude=True)
    sup.events.emit("fault_detected", **f.event_fields())
    sup.events.emit("fault_classified", **d.event_fields())
    sup.events.emit("node_lost", node=node, lease_age_s=round(age_s, 3), ranks=ranks)
    sup.store.set(f"excluded/{node}", "1")
    dead = {}
    for r in ranks:
        proc = sup.gen.members[r]
        sup.store.set(f"dead/{proc}", "1")
        dead[r] = {"proc": proc, "fault": "node_lost", "time": now, "occurred": now - age_s, "node": node}
    if dead:
        sup._next_generation(dead)
