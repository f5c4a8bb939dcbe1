"""Which standby shadow takes a failed rank (runtime/standby.py)."""
from hypothesis import given
from hypothesis import strategies as st

from unbroken.runtime.standby import Standby, pick_standby, slot_of_shadow

standbys = st.lists(st.builds(Standby, proc=st.text("abc", min_size=1, max_size=3), node=st.integers(0, 2),
                              slot=st.integers(0, 3), ready=st.booleans()), max_size=8)


@given(standbys, st.integers(0, 2), st.integers(0, 3))
def test_ready_first_then_the_failed_ranks_node_then_its_slot(cands, node, slot):
    best = pick_standby(cands, node=node, slot=slot)
    if not cands:
        assert best is None
        return
    assert best in cands
    if any(c.ready for c in cands):
        assert best.ready
    pool = [c for c in cands if c.ready == best.ready]
    if any(c.node == node for c in pool):
        assert best.node == node
    pool = [c for c in pool if c.node == best.node]
    if any(c.slot == slot for c in pool):
        assert best.slot == slot


def test_shadows_are_bound_round_robin_over_the_nodes_slots():
    assert [slot_of_shadow(i, 4) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    assert slot_of_shadow(3, 0) == 0  # a degenerate node of no slot: slot 0
    warm_elsewhere = Standby("n1-s0", 1, 2, True)
    cold_here = Standby("n0-s1", 0, 2, False)
    wrong_slot = Standby("n0-s0", 0, 0, True)
    right_slot = Standby("n0-s2", 0, 2, True)
    assert pick_standby([warm_elsewhere, cold_here], node=0, slot=2) == warm_elsewhere  # warm beats local
    assert pick_standby([wrong_slot, right_slot, warm_elsewhere], node=0, slot=2) == right_slot


class _Popen:
    def __init__(self, code):
        self.pid, self._code = 1, code

    def poll(self):
        return self._code


def _leader_with_shadows(exited: set[str], killed: set[str]):
    """A stand-in for the leader's Supervisor: node 0 of one, three ready shadows in its store."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from unbroken.runtime.procs import Child

    store, procs = dist.HashStore(), ["n0-s0", "n0-s1", "n0-s2"]
    for p in procs:
        store.set(f"shadows/0/{store.add('shadows/0/n', 1) - 1}", p)
        store.set(f"ready/{p}", "1")
    children = {p: Child(p, "shadow", _Popen(9 if p in exited else None)) for p in procs}
    started = []
    sup = SimpleNamespace(store=store, opts=SimpleNamespace(nnodes=1), node=0, local=3, killed=set(killed),
                          table=SimpleNamespace(children=children), _node_lost=lambda n: False,
                          _start_shadow=lambda cold: started.append(cold) or SimpleNamespace(proc="n0-s9"))
    return sup, started


def test_a_shadow_that_exited_or_was_killed_is_not_given_a_rank_before_its_fault_is_read():
    from unbroken.runtime.supervisor import Supervisor

    sup, started = _leader_with_shadows(exited={"n0-s0"}, killed={"n0-s1"})
    proc, cold = Supervisor._pick_shadow(sup, exclude=set(), prefer=0, slot=0)
    assert (proc, cold) == ("n0-s2", False) and sup.table.children["n0-s2"].taken
    sup, started = _leader_with_shadows(exited={"n0-s0", "n0-s2"}, killed={"n0-s1"})
    assert Supervisor._pick_shadow(sup, exclude=set(), prefer=0, slot=0) == ("n0-s9", True) and started == [True]
