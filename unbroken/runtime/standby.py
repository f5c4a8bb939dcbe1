"""Which standby shadow takes a failed rank, and the device slot each shadow is bound to.

A shadow starts bound to a slot of its node (LOCAL_RANK = the slot, as torchrun sets it
for the process on that GPU), round-robin over the node's slots, so that a script that
binds its device from LOCAL_RANK before `unbroken.Trainer(...)` blocks works in a shadow
too. For a failed rank the leader prefers, in order: a shadow that is ready (warm), on
the failed rank's node, bound to the failed rank's slot (the slot its process freed).
"""
from __future__ import annotations

from dataclasses import dataclass


def slot_of_shadow(seq: int, local_world: int) -> int:
    """The slot shadow number `seq` of a node is bound to."""
    return seq % max(1, local_world)


@dataclass(frozen=True)
class Standby:
    proc: str
    node: int
    slot: int
    ready: bool


def pick_standby(standbys: list[Standby], *, node: int, slot: int) -> Standby | None:
    """The best standby for a rank lost on `node` at `slot` (None: a cold start is needed)."""
    if not standbys:
        return None
    return min(standbys, key=lambda s: (not s.ready, s.node != node, s.slot != slot, s.proc))


def list_standbys(store, nodes: list[int], local_world: int, exclude: set[str]) -> list[Standby]:
    """The shadows of `nodes` (the store's `shadows/{node}/{i}` registry) that are still free: not in
    `exclude`, not assigned, not dead; each with its slot and whether it is ready."""
    out = []
    for node in nodes:
        for i in range(store.add(f"shadows/{node}/n", 0)):
            proc = store.get(f"shadows/{node}/{i}").decode()
            if proc in exclude or store.check([f"assign/{proc}"]) or store.check([f"dead/{proc}"]):
                continue
            out.append(Standby(proc, node, slot_of_shadow(i, local_world), store.check([f"ready/{proc}"])))
    return out
