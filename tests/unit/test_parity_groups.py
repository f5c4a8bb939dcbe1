"""Parity groups: a partition of the ranks; across nodes, no two members share a node."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from unbroken.parallel.groups import ParityGroups


@st.composite
def shapes(draw):
    nnodes = draw(st.integers(1, 8))
    local = draw(st.integers(1, 8))
    world = nnodes * local
    k = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    return world, k, nnodes


@given(shapes())
def test_groups_partition_the_ranks_and_index_consistently(shape):
    world, k, nnodes = shape
    g = ParityGroups(world, k, nnodes)
    seen = sorted(r for grp in range(g.count) for r in g.ranks(grp))
    assert seen == list(range(world))
    for r in range(world):
        assert g.rank_of(g.group_of(r), g.member_of(r)) == r
        assert 0 <= g.member_of(r) < k


@given(shapes())
def test_across_nodes_members_sit_on_different_nodes_when_k_fits(shape):
    world, k, nnodes = shape
    g, local = ParityGroups(world, k, nnodes), world // nnodes
    if nnodes == 1 or k > nnodes:
        return
    for grp in range(g.count):
        nodes = [r // local for r in g.ranks(grp)]
        assert len(set(nodes)) == len(nodes)  # a whole node lost costs each group one member at most


def test_one_node_keeps_consecutive_groups():
    assert ParityGroups(8, 2).ranks(1) == [2, 3]
    assert ParityGroups(4, 2, nnodes=2).ranks(0) == [0, 2]
