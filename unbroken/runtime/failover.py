"""Who leads a job on the replicated store, and how a survivor takes over when the leader's node is lost.

With `--store etcd://...` every node renews its lease (runtime/lease.py) and watches every other
node's; the store key `leader` names the leader (node 0 at start). A follower that sees the
leader's lease expire, and is the lowest node whose lease it still sees renewed, claims the role
with one compare_set (`leader`: old -> itself), so exactly one claimant wins even if two see the
loss at once. The winner rebuilds the leader's view from the store (newest generation, the fault
log's cursor, progress) and replaces the old leader's ranks as one node-loss incident. A leader
that finds another node named (it was taken for lost while alive) stops: it must not act twice.
"""
from __future__ import annotations

import time

import torch.distributed as dist

from unbroken.runtime import lease, membership
from unbroken.runtime.options import LaunchError

LEADER_KEY = "leader"
CURSOR_KEY = "faults/cursor"  # the first fault record the leader has not acted on


class LeaderWatch:
    """A follower's view of every other node's lease, and its claim when the leader's expires."""

    def __init__(self, node: int, nnodes: int, lease_s: float, *, clock=time.monotonic) -> None:
        self.node, self.nnodes = node, nnodes
        self.leases = lease.NodeLeases(nnodes, lease_s, nodes=[n for n in range(nnodes) if n != node], clock=clock)
        self._lost_age: dict[int, float] = {}

    def poll(self, store: dist.Store) -> tuple[int, float] | None:
        """(old leader, its lease age when found lost) once this node won the role; else None."""
        for n, age in self.leases.observe(store):
            self._lost_age[n] = age
        leader = int(store.get(LEADER_KEY))
        if leader == self.node or leader not in self.leases.lost:
            return None
        alive = [n for n in range(self.nnodes) if n == self.node or n not in self.leases.lost]
        if min(alive) != self.node:
            return None  # a lower survivor claims it; if it cannot, its lease expires and we try again
        if store.compare_set(LEADER_KEY, str(leader), str(self.node)) != str(self.node).encode():
            return None
        return leader, self._lost_age.get(leader, self.leases.lease_s)


def check_still_leader(store: dist.Store, node: int) -> None:
    """The leader's check every heartbeat: LaunchError if the store names another leader."""
    now = store.get(LEADER_KEY).decode()
    if now != str(node):
        raise LaunchError(f"node {node} was taken for lost and node {now} leads the job now: this node stopped "
                          "its processes; check the network between the nodes")


def take_over(sup, old: int, age_s: float) -> None:
    """`sup` (a follower's Supervisor) becomes the leader: the leader's state from the store, then
    the old leader's node is lost (its ranks go to the shadows of the nodes left)."""
    store = sup.store
    sup.events.emit("leader_elected", node=sup.node, previous=old, lease_age_s=round(age_s, 3))
    sup.leader = True
    sup.leases, sup.leader_watch = sup.leader_watch.leases, None
    sup.joined = {n for n in range(sup.opts.nnodes) if n != sup.node and n not in sup.leases.lost}
    sup.gen = membership.read_generation(store, membership.latest_gen(store), timeout_s=30)
    sup.events.gen = sup.gen.gen
    sup.fault_log.skip_to(int(store.get(CURSOR_KEY)) if store.check([CURSOR_KEY]) else 0)
    sup._last_step = (membership.get(store, "progress") or {}).get("step", 0)
    sup._lose_node(old, age_s)
