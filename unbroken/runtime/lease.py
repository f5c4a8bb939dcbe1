"""Node leases: the leader's proof that every other node's supervisor is alive.

A supervisor's children are watched by that supervisor; nobody watches the supervisor
itself, so a host that vanishes (its supervisor and children SIGKILLed, power lost) or
freezes (SIGSTOP, a hung kernel) would go unreported. Every supervisor therefore renews
its lease once per loop tick (`renew`: one atomic counter add in the store). The leader
notes, on its own monotonic clock, when each node's counter last moved (no cross-host
clock comparison); a node whose counter has not moved for `lease_s` is lost: the leader
replaces all its ranks at once (one node-loss incident). A link regroup needs proof that
every node renewed after the collective error (`renewed_after`): a dead host must not be
regrouped as though only its link had broken.
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


def lose_node(sup, node: int, age_s: float, ranks: list[int]) -> None:
    """`sup` (the leader's Supervisor) found `node`'s lease expired: record it, fence the node off
    (excluded: if it comes back it stops its processes and leaves), and replace all its `ranks` at once."""
    from unbroken.detect import Finding, classify

    now, ranks = time.time(), sorted(ranks)
    f = Finding(fault="node_lost", proc=f"node{node}", rank=None, node=node, time=now,
                evidence={"why": f"node {node}'s supervisor has not renewed its lease for {age_s:.1f}s "
                                 f"(node_lease_s={sup.cfg.node_lease_s})", "ranks": ranks,
                          "lease_age_s": round(age_s, 3)})
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
