"""A node lost whole is one node-loss incident whichever the leader sees first: its ranks' crash
reports (its supervisor may send them in the instant before it dies with them) or its lease's
expiry. The leader's real decision code (Supervisor._take_faults, _check_leases) on a faked
store and clock; nothing is started."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from unbroken.detect import OffenderTable
from unbroken.events import EventLog, read_events
from unbroken.runtime import membership
from unbroken.runtime.crash import CrashJudge
from unbroken.runtime.lease import FaultHold, NodeLeases, renew
from unbroken.runtime.supervisor import Supervisor

pytestmark = pytest.mark.timeout(60)
LEASE_S, TICK_S = 1.0, 0.1


class _Store:
    """The few store calls the leader's decisions make, on a dict."""

    def __init__(self) -> None:
        self.v: dict[str, object] = {}

    def add(self, key: str, n: int) -> int:
        self.v[key] = int(self.v.get(key, 0)) + n
        return self.v[key]

    def set(self, key: str, value) -> None:
        self.v[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.v[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.v for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.v.pop(key, None) is not None


class _Leader:
    """Node 0's supervisor in a 2-node job of 4 ranks (n0-w0, n0-w1 | n1-w2, n1-w3), reduced to its
    decisions: each generation it would start is recorded (its cause, as the real one names it)."""

    _take_faults = Supervisor._take_faults
    _check_leases = Supervisor._check_leases
    _lose_node = Supervisor._lose_node
    _rank_of = Supervisor._rank_of
    _check_link = Supervisor._check_link

    def __init__(self, run_dir) -> None:
        self.now = 0.0
        self.node, self.replicated, self._quiet, self._collerr, self._link_regroups = 0, False, False, None, 0
        self.cfg = SimpleNamespace(node_lease_s=LEASE_S, heartbeat_s=TICK_S)
        self.store = _Store()
        self.events = EventLog(run_dir / "events.jsonl", source="supervisor", node=0)
        self.gen = membership.Generation(0, {r: f"n{r // 2}-w{r}" for r in range(4)}, (), "start")
        self.leases = NodeLeases(2, LEASE_S, clock=lambda: self.now)
        self.held = FaultHold()
        self.fault_log = membership.FaultLogReader(self.store)
        self.crashes = CrashJudge(self.store, self.events)
        self.watch = SimpleNamespace(offenders=OffenderTable())
        self.causes: list[str] = []

    def _next_generation(self, dead: dict[int, dict], link: dict | None = None) -> None:
        self.causes.append(membership.incident_cause(dead))
        members = {r: (f"n0-s{r}" if r in dead else p) for r, p in self.gen.members.items()}
        self.gen = membership.Generation(self.gen.gen + 1, members, tuple(sorted(dead)), self.causes[-1])

    def tick(self, *, node1_renews: bool) -> None:
        """One heartbeat: node 1 renews (or not), then the leader's loop order: leases, then the fault log."""
        self.now += TICK_S
        if node1_renews:
            renew(self.store, 1)
        self._check_leases()
        self._take_faults(self.now)


def _node1_reports(leader: _Leader, *procs: str, fault: str = "crash") -> None:
    """Node 1's supervisor reports its processes' faults (as supervisor._hand_to_leader does)."""
    for proc in procs:
        membership.report_fault(leader.store, {"proc": proc, "fault": fault, "time": leader.now,
                                               "occurred": leader.now, "node": 1, "action": "in_place"})


def _until_lease_expires(leader: _Leader) -> None:
    for _ in range(int(3 * LEASE_S / TICK_S)):
        leader.tick(node1_renews=False)


@pytest.fixture
def leader(tmp_path) -> _Leader:
    got = _Leader(tmp_path)
    for _ in range(3):
        got.tick(node1_renews=True)
    return got


def test_crash_reports_first_then_the_lease_expires_is_one_node_loss(leader, tmp_path):
    _node1_reports(leader, "n1-w2", "n1-w3")
    renew(leader.store, 1)  # its loop renews right after reporting, in the same tick, then dies
    _until_lease_expires(leader)
    assert leader.causes == ["node_lost@rank2,node_lost@rank3"]
    [found] = [e for e in read_events(tmp_path / "events.jsonl") if e.kind == "fault_detected"]
    assert found.fields["fault"] == "node_lost"
    assert found.fields["evidence"]["reports_held"] == ["crash@n1-w2", "crash@n1-w3"]


def test_the_lease_expires_first_then_crash_reports_is_the_same_node_loss(leader):
    _until_lease_expires(leader)
    _node1_reports(leader, "n1-w2", "n1-w3")  # late: their processes are no members any more
    leader.tick(node1_renews=False)
    assert leader.causes == ["node_lost@rank2,node_lost@rank3"]


def test_a_node_that_renewed_once_after_the_collective_errors_is_not_regrouped_as_a_link(leader):
    """Node 0's ranks' collectives fail first; node 1's supervisor reports its crashes and renews
    one last time before it dies: that renewal is no proof of life for a link regroup."""
    membership.report_fault(leader.store, {"proc": "n0-w0", "fault": "collective_error", "gen": 0, "rank": 0,
                                           "time": leader.now, "error": "peer closed"})
    leader.tick(node1_renews=False)
    _node1_reports(leader, "n1-w2", "n1-w3")
    renew(leader.store, 1)
    _until_lease_expires(leader)
    assert leader.causes == ["node_lost@rank2,node_lost@rank3"]


def test_a_crash_on_a_live_node_waits_for_its_next_renewal_only(leader):
    _node1_reports(leader, "n1-w2")
    renew(leader.store, 1)  # before the leader read the report: no proof that node 1 outlived it
    leader.tick(node1_renews=False)
    assert leader.causes == [] and leader.held
    leader.tick(node1_renews=True)
    assert leader.causes == ["crash@rank2"] and not leader.held


def test_the_leaders_own_crashes_and_members_failed_collectives_are_never_held(leader):
    membership.report_fault(leader.store, {"proc": "n0-w1", "fault": "crash", "time": leader.now,
                                           "occurred": leader.now, "node": 0, "action": "in_place"})
    membership.report_fault(leader.store, {"proc": "n1-w3", "fault": "collective_error", "gen": 0, "rank": 3,
                                           "time": leader.now, "error": "peer closed"})
    leader.tick(node1_renews=False)
    assert leader.causes == ["crash@rank1"] and not leader.held and leader._collerr["rank"] == 3


def test_a_held_record_keeps_the_cursor_a_new_leader_reads_from():
    store, hold = _Store(), FaultHold()
    leases = NodeLeases(3, LEASE_S, clock=lambda: 0.0)
    taken = [(0, {"proc": "n1-w2", "fault": "crash", "node": 1}), (1, {"proc": "n2-w4", "fault": "hang", "node": 2})]
    renew(store, 2)
    assert hold.admit(taken, leases, store) == [] and hold.cursor(2) == 0
    renew(store, 2)  # node 2 outlived its report; node 1 did not renew
    assert hold.admit([], leases, store) == [taken[1][1]] and hold.cursor(2) == 0
    leases.forget(1)  # excluded: its records move its ranks
    assert hold.admit([], leases, store) == [taken[0][1]] and hold.cursor(2) == 2 and not hold
