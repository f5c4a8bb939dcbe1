"""Detectors: hang deadlines, silence, stalls, crashes, stragglers, numerics, host and health."""
from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.detect.detectors import Detector, DetectorConfig, Finding, exit_evidence, numerics_check
from unbroken.detect.signals import Heartbeat, HostSignals, ProbeResult

CFG = DetectorConfig(heartbeat_s=0.1, min_deadline_s=1.0, deadline_factor=5.0, startup_deadline_s=60.0,
                     straggler_window_steps=5, straggler_windows=3)


def hb(rank: int, step: int, phase: str, t: float, step_s: float | None = None,
       wait_s: float | None = None) -> Heartbeat:
    return Heartbeat(proc=f"w{rank}", rank=rank, node=rank // 2, step=step, phase=phase, time=t,
                     step_s=step_s, wait_s=wait_s)


def run_steps(det: Detector, steps: range, *, step_s=0.1, slow: dict[int, float] | None = None,
              wait: dict[int, float] | None = None, t0: float = 0.0, ranks: int = 4) -> float:
    """Feed lock-step training: every rank reports each step; returns the last time."""
    t = t0
    for s in steps:
        t += step_s
        for r in range(ranks):
            st_ = step_s * (slow or {}).get(r, 1.0)
            det.observe(hb(r, s + 1, "forward", t, step_s=st_, wait_s=(wait or {}).get(r, 0.0)))
    return t


@pytest.mark.parametrize("kw, msg", [
    ({"heartbeat_s": 0}, "heartbeat_s"), ({"silence_heartbeats": 0.5}, "silence_heartbeats"),
    ({"straggler_factor": 1.0}, "straggler_factor"), ({"straggler_windows": 0}, "straggler_windows"),
    ({"spike_min_history": 200}, "spike_min_history"), ({"min_mem_available_frac": 1.5}, "min_mem"),
    ({"phase_deadlines_s": (("init", -1.0),)}, "phase_deadlines_s"),
    ({"running_silence_heartbeats": 1.0}, "running_silence_heartbeats"),
])
def test_config_rejects_bad_thresholds_naming_them(kw, msg):
    with pytest.raises(ValueError, match=msg):
        DetectorConfig(**kw)


def test_hang_deadline_is_derived_from_observed_step_times():
    det = Detector(CFG)
    assert det.deadline("forward") == (60.0, "startup deadline (no step time observed yet)")
    run_steps(det, range(50), step_s=0.1)
    assert det.deadline("forward")[0] == 1.0                       # 5 x 0.1 s is under the 1 s floor
    run_steps(det, range(50, 100), step_s=0.4, t0=10.0)
    limit, basis = det.deadline("forward")
    assert limit == pytest.approx(2.0) and "p99" in basis          # 5 x p99 (0.4 s)
    assert det.deadline("checkpoint")[0] == 300.0                  # fixed per-phase deadline


def test_no_progress_in_compute_is_a_hang_with_evidence():
    det = Detector(CFG)
    t = run_steps(det, range(20))
    # rank 2 is stuck in backward of step 21 while heartbeating; the others wait in allreduce
    found = []
    for k in range(1, 50):
        now = t + 0.1 * k
        det.observe(hb(2, 21, "backward", now, step_s=0.1))
        for r in (0, 1, 3):
            det.observe(hb(r, 21, "allreduce", now, step_s=0.1))
        found += det.check(now)
    # one hang, on the culprit; the waiters are its victims, not a stall
    assert [(f.fault, f.rank) for f in found] == [("hang", 2)]
    ev = found[0].evidence
    assert ev["why"] == "no progress" and ev["phase"] == "backward" and ev["step"] == 21
    assert ev["no_progress_s"] > ev["deadline_s"] == 1.0 and ev["ranks_in_collective"] == [0, 1, 3]


def test_everyone_stuck_in_a_collective_is_one_stall():
    det = Detector(CFG)
    t = run_steps(det, range(20))
    for k in range(1, 30):
        for r in range(4):
            det.observe(hb(r, 21, "allreduce", t + 0.1 * k, step_s=0.1))
    found = det.check(t + 2.9)
    assert [f.fault for f in found] == ["stall"]
    assert found[0].rank is None and found[0].evidence["ranks"] == [0, 1, 2, 3]
    assert det.check(t + 3.0) == []                                # latched until reset


def test_a_wait_on_a_late_node_is_no_stall_once_its_lease_decides():
    det = Detector(CFG)
    t = run_steps(det, range(20))

    def wait_until(end: float, start: float) -> None:
        for k in range(1, round((end - start) / 0.1) + 1):
            for r in range(4):
                det.observe(hb(r, 21, "allreduce", start + 0.1 * k, step_s=0.1))

    wait_until(t + 2.9, t)
    assert det.check(t + 2.9, hold_hangs=True) == []  # a node's lease is late: held
    det.restart_clocks(t + 2.9)                        # its lease decided (the node was declared lost)
    wait_until(t + 3.5, t + 2.9)
    assert det.check(t + 3.5) == []                    # the wait so far is explained, not a stall
    wait_until(t + 4.0, t + 3.5)
    assert [f.fault for f in det.check(t + 4.0)] == ["stall"]  # a real one is still found after


def test_heartbeat_silence_is_a_hang_within_two_intervals():
    det = Detector(CFG)
    t = run_steps(det, range(10))
    for r in (0, 1, 3):
        det.observe(hb(r, 11, "forward", t + 0.1))
    assert det.check(t + 0.14) == []                               # under 1.5 intervals: not yet
    found = det.check(t + 0.16)
    assert [(f.fault, f.rank) for f in found] == [("hang", 2)]
    assert found[0].evidence["why"] == "heartbeat silence"


def test_a_finished_process_falling_silent_is_no_hang():
    """A worker that reported "done" stops beating as it exits (a stop-37 test run flagged one
    0.152 s after its last beat, with a 0.15 s limit, after the job's last step)."""
    det = Detector(CFG)
    t = run_steps(det, range(10))
    for r in range(4):
        det.observe(hb(r, 10, "done" if r == 2 else "forward", t + 0.1))
    for r in (0, 1, 3):
        det.observe(hb(r, 11, "forward", t + 0.3))
    assert det.check(t + 0.32) == []
    assert det.check(t + 0.32, states={"w2": None}) == []


def test_a_finished_process_the_kernel_shows_stopped_is_a_hang():
    """A SIGSTOP after the "done" beat: the kernel's 'T' is certain evidence, done or not (stranded
    recovery's test stops rank 2 in finish(); ignoring its silence left the job waiting forever)."""
    det = Detector(CFG)
    t = run_steps(det, range(10))
    for r in range(4):
        det.observe(hb(r, 10, "done", t + 0.1))
    found = det.check(t + 0.32, states={"w0": "S", "w1": "R", "w2": "T", "w3": None})
    assert [(f.fault, f.rank, f.evidence["phase"]) for f in found] == [("hang", 2, "done")]


def test_silence_of_a_running_process_is_given_more_time_but_a_stopped_one_is_not():
    det = Detector(CFG)
    t = run_steps(det, range(10))
    assert det.check(t + 0.5, states={f"w{r}": "R" for r in range(4)}) == []
    found = det.check(t + 0.5, states={"w0": "R", "w1": "S", "w2": "T", "w3": "Z"})
    assert [(f.fault, f.rank, f.evidence["proc_state"]) for f in found] == [("hang", 2, "T")]


def test_crash_and_exception_come_from_the_exit_status():
    det = Detector(CFG)
    run_steps(det, range(5))
    det.observe_exit("w0", 0, 0, 0, 1.0)
    det.observe_exit("w1", 1, 0, -9, 1.0)
    det.observe_exit("w2", 2, 1, 1, 1.0)
    det.observe_exit("w3", 3, 1, 0, 1.0)
    found = {f.rank: f for f in det.check(1.0)}
    assert set(found) == {1, 2}
    assert found[1].fault == "crash" and found[1].evidence["signal"] == "SIGKILL"
    assert found[2].fault == "exception" and found[2].evidence["returncode"] == 1
    assert det.check(5.0) == []                                    # exited procs are not "silent"


@pytest.mark.parametrize("rc, fault, sig", [(-9, "crash", "SIGKILL"), (-11, "crash", "SIGSEGV"),
                                            (137, "crash", "SIGKILL"), (1, "exception", None),
                                            (2, "exception", None)])
def test_exit_evidence_table(rc, fault, sig):
    f, ev = exit_evidence(rc)
    assert f == fault and ev.get("signal") == sig and ev["returncode"] == rc


def test_killing_a_hung_rank_is_not_a_second_fault():
    det = Detector(CFG)
    t = run_steps(det, range(10))
    assert [f.fault for f in det.check(t + 1.0)] == ["hang"] * 4   # nobody heartbeats any more
    det.observe_exit("w2", 2, 1, -9, t + 1.1)                      # the watchdog's SIGKILL
    assert det.check(t + 1.2) == []


def test_reset_and_forget_restart_watching():
    det = Detector(CFG)
    t = run_steps(det, range(10))
    det.check(t + 1.0)
    det.forget("w3")
    det.reset(t + 1.0)
    assert det.watching() == ["w0", "w1", "w2"]
    assert det.check(t + 1.1) == []
    assert {f.rank for f in det.check(t + 1.3)} == {0, 1, 2}       # silent again after the reset


def test_straggler_only_when_persistent():
    det = Detector(CFG)
    t = run_steps(det, range(10))                                   # windows 0-1: all equal
    t = run_steps(det, range(10, 20), slow={3: 2.0}, t0=t)          # windows 2-3: rank 3 slow
    assert det.check(t) == []                                       # two windows: not persistent yet
    t = run_steps(det, range(20, 25), t0=t)                         # window 4: recovered
    t = run_steps(det, range(25, 35), slow={3: 2.0}, t0=t)          # windows 5-6: slow again
    assert det.check(t) == []                                       # the streak restarted
    t = run_steps(det, range(35, 45), slow={3: 2.0}, t0=t)          # windows 7-8
    found = det.check(t)
    assert [(f.fault, f.rank, f.node) for f in found] == [("straggler", 3, 1)]
    ev = found[0].evidence
    assert ev["ratio"] == pytest.approx(2.0) and ev["windows"] == 3 and ev["median_s"] == pytest.approx(0.1)
    t = run_steps(det, range(45, 60), slow={3: 2.0}, t0=t)
    assert det.check(t) == []                                       # flagged once, not every window


def test_straggler_is_judged_on_busy_time_not_the_synchronised_step_time():
    det = Detector(CFG)
    # synchronous training: every step takes 0.3 s everywhere, but ranks 0-2 wait 0.2 s for rank 1's peers
    t = run_steps(det, range(20), step_s=0.3, wait={0: 0.2, 1: 0.0, 2: 0.2, 3: 0.2})
    found = det.check(t)
    assert [(f.fault, f.rank) for f in found] == [("straggler", 1)]
    assert found[0].evidence["wait_s"] == 0.0 and found[0].evidence["peers_wait_s"] == pytest.approx(0.2)


def test_tiny_absolute_differences_never_make_a_straggler():
    det = Detector(CFG)
    t = run_steps(det, range(40), step_s=0.001, slow={2: 3.0})      # 3x slower, but by 2 ms
    assert det.check(t) == []


@pytest.mark.parametrize("loss, grad, what", [(float("nan"), 1.0, "loss_nonfinite"),
                                              (1.0, float("inf"), "grad_nonfinite"),
                                              (1.0, 50.0, "grad_spike")])
def test_numerics_findings(loss, grad, what):
    f = numerics_check(loss, grad, [1.0 + 0.01 * i for i in range(30)], config=CFG, proc="w0", rank=0,
                       node=0, step=31, now=5.0)
    assert isinstance(f, Finding) and f.fault == "numerics" and f.evidence["what"] == what
    assert f.evidence["step"] == 31 and f.time == 5.0


def test_no_spike_verdict_before_enough_history():
    assert numerics_check(1.0, 1e6, [1.0] * 19, config=CFG) is None
    assert numerics_check(1.0, 1e6, [1.0] * 20, config=CFG) is not None


@settings(max_examples=60, deadline=None)
@given(history=st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=20, max_size=150),
       frac=st.floats(min_value=0.0, max_value=1.0))
def test_norms_within_the_spike_factor_are_never_flagged(history, frac):
    median = statistics.median(history[-CFG.spike_window:])
    grad = frac * CFG.spike_factor * median
    assert numerics_check(2.0, grad, history, config=CFG) is None
    assert numerics_check(2.0, CFG.spike_factor * median * 1.01, history, config=CFG) is not None
    assert numerics_check(math.nan, grad, history, config=CFG) is not None


def test_failed_health_probe_is_a_finding_once_per_node():
    det = Detector(CFG)
    bad = ProbeResult(probe="nvidia-smi", ok=False, problems=("GPU 3: 4 uncorrected ECC errors",))
    det.observe_health(1, None, 1.0)                                # skipped probe: nothing
    det.observe_health(1, bad, 1.0)
    det.observe_health(1, bad, 2.0)
    found = det.check(2.0)
    assert [(f.fault, f.node) for f in found] == [("health", 1)]
    assert found[0].evidence["problems"] == ["GPU 3: 4 uncorrected ECC errors"]
    det.observe_health(1, ProbeResult(probe="nvidia-smi", ok=True), 3.0)
    det.observe_health(1, bad, 4.0)
    assert len(det.check(4.0)) == 1                                 # a new failure after recovery


def test_host_signals_warn_once_and_ride_along_as_evidence():
    det = Detector(CFG)
    low = HostSignals(load1=7.5, mem_available_gb=0.2, mem_total_gb=16.0, disk_free_gb=0.5)
    warnings = det.observe_host(1, low)
    assert len(warnings) == 2 and any("GB free" in w for w in warnings)
    assert det.observe_host(1, low) == []
    det.observe_exit("w2", 2, 1, -9, 1.0)
    assert det.check(1.0)[0].evidence["host"]["load"] == 7.5


def test_a_spawned_process_gets_the_init_deadline_not_the_silence_limit():
    det = Detector(CFG)
    det.expect("w0", 0, 0, 0.0)
    assert det.check(5.0) == []                                     # importing torch: silent, but no verdict
    assert [f.evidence["why"] for f in det.check(301.0)] == ["no progress"]  # never came up at all
    det.expect("w1", 1, 0, 400.0)
    det.observe(hb(1, 0, "forward", 402.0))
    assert [f.evidence["why"] for f in det.check(402.2)] == ["heartbeat silence"]


def test_an_idle_shadow_is_watched_for_silence_only():
    det = Detector(CFG)
    for k in range(100):
        det.observe(Heartbeat(proc="s0", rank=None, node=0, step=0, phase="standby", time=0.1 * k))
        assert det.check(0.1 * k + 0.05) == []
    assert [f.proc for f in det.check(10.2)] == ["s0"]
