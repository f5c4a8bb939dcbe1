"""steps_lost is measured from the events: committed steps whose update the resumed state lacks."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.detect.report import RunLog, analyze, steps_lost_by_gen
from unbroken.events import Event
from unbroken.runtime.breakdown import recoveries, steps_lost_total

RANKS = 4


class Log:
    """A synthetic run: 4 ranks commit steps; faults, generations and resumptions in between."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.t, self.gen = 1000.0, 0

    def emit(self, kind: str, *, rank: int | None = None, **fields) -> None:
        self.t += 0.01
        self.events.append(Event(time=self.t, kind=kind, rank=rank, gen=self.gen, fields=fields))

    def steps(self, first: int, last: int, ranks=range(RANKS)) -> None:
        for s in range(first, last + 1):
            for r in ranks:
                self.emit("step", rank=r, step=s, loss=1.0)

    def fault(self, rank: int = 2) -> None:
        self.emit("fault_injected", rank=rank, fault="sigkill", phase="optimizer", step=0)
        self.emit("fault_detected", rank=rank, fault="crash", proc=f"w{rank}")
        self.gen += 1
        self.emit("generation", gen=self.gen, members={}, replaced=[rank], cause="crash")
        self.emit("recovery_phase", rank=0, phase="regroup", start=self.t, end=self.t)

    def resume(self, step: int, path: str = "tier1") -> None:
        self.emit("recovery_phase", rank=0, phase="rebuild", start=self.t, end=self.t)
        if path == "tier2":
            for r in range(RANKS):
                self.emit("tier2_restore", rank=r, step=step, reason="two losses in a parity group")
        else:
            self.emit("recovered", rank=0, step=step, steps_lost=0, steps_redone=1, path=path)


def test_no_recovery_loses_nothing():
    log = Log()
    log.steps(1, 8)
    assert steps_lost_by_gen(log.events) == {} and steps_lost_total(log.events) == 0


def test_tier1_redo_and_roll_forward_lose_nothing():
    log = Log()
    log.steps(1, 4)
    log.fault()
    log.resume(4)  # redo: the interrupted step 5 is done again, step 4 is kept
    log.steps(5, 6)
    log.fault()
    log.resume(7)  # roll forward: step 7's all-reduce completed, its update is finished
    log.steps(8, 8)
    assert steps_lost_by_gen(log.events) == {1: 0, 2: 0}
    [a, b] = recoveries(log.events)
    assert (a["complete"], a["steps_lost"], b["steps_lost"]) == (True, 0, 0)
    assert steps_lost_total(log.events) == 0


def test_a_tier2_restore_to_an_older_checkpoint_loses_the_steps_after_it():
    log = Log()
    log.steps(1, 7)
    log.fault()
    log.resume(4, path="tier2")  # step 7 had committed: 5, 6 and 7 are lost
    log.steps(5, 8)
    assert steps_lost_by_gen(log.events) == {1: 3}
    [rec] = recoveries(log.events)
    assert rec["complete"] and rec["path"] == "tier2" and rec["resumed_at_step"] == 5 and rec["steps_lost"] == 3
    assert steps_lost_total(log.events) == 3
    assert analyze([RunLog("run", log.events)])["steps_lost"] == 3  # `unbroken report` shows the measured figure


def test_a_deferred_decode_rolled_back_after_recovered_counts_from_the_checkpoint():
    log = Log()
    log.steps(1, 6)
    log.fault()
    log.resume(6)
    log.emit("tier2_restore", rank=0, step=2, reason="a tier-1 decoded chunk failed its checksum")
    log.steps(3, 8)
    assert steps_lost_by_gen(log.events) == {1: 4}
    [rec] = recoveries(log.events)
    assert rec["path"] == "tier2" and rec["resumed_at_step"] == 3


def _collerr_then(resumed: int, path: str) -> list[Event]:
    # rank 0's all-reduce of step 5 failed after its peers' completed: they commit 5, rank 0 does not
    log = Log()
    log.steps(1, 4)
    log.emit("fault_injected", rank=0, fault="collerr", phase="reduced", step=5)
    log.steps(5, 5, ranks=[1, 2, 3])
    log.emit("fault_detected", fault="stall", proc="group")
    log.gen = 1
    log.emit("generation", gen=1, members={}, replaced=[], cause="link")
    log.resume(resumed, path=path)
    return log.events


def test_a_step_committed_by_some_ranks_after_the_fault_counts_as_committed():
    assert steps_lost_by_gen(_collerr_then(5, "replica")) == {1: 0}
    assert steps_lost_by_gen(_collerr_then(4, "tier2")) == {1: 1}  # a restore to 4 would undo their step 5


def test_a_superseded_generation_is_counted_once_by_the_one_that_resumed():
    log = Log()
    log.steps(1, 5)
    log.fault(rank=1)
    log.fault(rank=2)  # generation 1 never resumed: generation 2 accounts for its incident
    log.resume(4, path="tier2")
    log.steps(5, 8)
    assert steps_lost_by_gen(log.events) == {1: None, 2: 1}
    a, b = recoveries(log.events)
    assert (a["complete"], a["steps_lost"]) == (False, None) and (b["complete"], b["steps_lost"]) == (True, 1)
    assert steps_lost_total(log.events) == 1


def test_a_job_that_ended_while_recovering_has_no_total():
    log = Log()
    log.steps(1, 5)
    log.fault()
    assert steps_lost_by_gen(log.events) == {1: None} and steps_lost_total(log.events) is None


def test_each_rollback_counts_the_steps_it_undid_once():
    log = Log()
    log.steps(1, 7)
    log.fault()
    log.resume(4, path="tier2")  # 5..7 lost
    log.steps(5, 5)
    log.fault()
    log.resume(4, path="tier2")  # the redone 5 lost again; 6 and 7 not a second time
    log.steps(5, 8)
    assert steps_lost_by_gen(log.events) == {1: 3, 2: 1} and steps_lost_total(log.events) == 4


def test_a_simulated_run_without_step_events_keeps_the_loss_it_logged():
    log = Log()
    log.fault()
    log.emit("recovered", step=40, steps_lost=7, steps_redone=7, path="tier2")  # as sim/eventlog.py writes it
    log.emit("step", step=47)
    assert steps_lost_by_gen(log.events) == {1: 7}


@st.composite
def schedules(draw):
    """Incidents as (steps committed before it, how training resumes, checkpoint age, superseded)."""
    n = draw(st.integers(1, 5))
    return [(draw(st.integers(0, 4)), draw(st.sampled_from(["redo", "forward", "tier2", "rollback"])),
             draw(st.integers(0, 6)), draw(st.booleans())) for _ in range(n)], draw(st.booleans()), draw(st.randoms())


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_measured_steps_lost_equals_a_naive_model(schedule):
    """Replay a random schedule: the naive model keeps the committed step and subtracts what
    each resumption gives up; the ranks' step events are interleaved at random and the list
    handed over unsorted."""
    incidents, last_unresumed, rnd = schedule
    log, committed, expected = Log(), 0, {}
    for progress, how, age, superseded in incidents:
        for s in range(committed + 1, committed + progress + 1):
            for r in rnd.sample(range(RANKS), RANKS):
                log.emit("step", rank=r, step=s, loss=1.0)
        committed += progress
        if superseded:  # a first generation for this incident that never resumes
            log.fault(rank=1)
            expected[log.gen] = None
        log.fault()
        ckpt = max(0, committed - age)
        if how == "redo":
            log.resume(committed)
            resumed = committed
        elif how == "forward":
            log.resume(committed + 1)
            resumed = committed + 1
        elif how == "tier2":
            log.resume(ckpt, path="tier2")
            resumed = ckpt
        else:  # a deferred decode that fails its checksum after `recovered`
            log.resume(committed)
            log.emit("tier2_restore", rank=0, step=ckpt, reason="checksum")
            resumed = ckpt
        expected[log.gen] = max(0, committed - resumed)
        committed = resumed
    if last_unresumed:
        log.steps(committed + 1, committed + 1)
        log.fault()
        expected[log.gen] = None
    shuffled = list(log.events)
    rnd.shuffle(shuffled)
    assert steps_lost_by_gen(shuffled) == expected
    total = steps_lost_total(log.events)
    assert total == (None if last_unresumed else sum(v for v in expected.values() if v is not None))
    assert all(r["steps_lost"] == expected[r["gen"]] for r in recoveries(log.events))

