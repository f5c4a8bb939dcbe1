"""Which ranks form each tier-1 parity group.

Tier 1 survives one lost member per group. On one node any k ranks do; across nodes a
whole node can vanish at once, so no two members of a group should share a node. Ranks
are numbered node by node (node n holds ranks n*local .. n*local+local-1), so groups are
*strided* when the job spans nodes: group g = {g, g+G, g+2G, ...} with G = world/k groups.
Members then sit on k different nodes whenever k <= nnodes (G >= local), and losing one
node costs each group at most one member. On one node the groups are consecutive ranks
(group g = {g*k .. g*k+k-1}), as before. Either way `member` (the index inside the group)
orders the group's collectives and parity rotation; the grouping never changes the
training arithmetic, only where parity lives.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParityGroups:
    world: int
    k: int
    nnodes: int = 1

    def __post_init__(self) -> None:
        if self.k < 1 or self.world % self.k:
            raise ValueError(f"parity group size {self.k} must divide world size {self.world}")

    @property
    def strided(self) -> bool:
        return self.nnodes > 1 and self.k > 1

    @property
    def count(self) -> int:
        return self.world // self.k

    def group_of(self, rank: int) -> int:
        return rank % self.count if self.strided else rank // self.k

    def member_of(self, rank: int) -> int:
        return rank // self.count if self.strided else rank % self.k

    def ranks(self, group: int) -> list[int]:
        """The group's ranks, by member index."""
        if self.strided:
            return [group + i * self.count for i in range(self.k)]
        return [group * self.k + i for i in range(self.k)]

    def rank_of(self, group: int, member: int) -> int:
        return self.ranks(group)[member]
