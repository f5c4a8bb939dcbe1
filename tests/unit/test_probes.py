"""Host and GPU probes run off the supervisor loop (issue 12, item 9).

`Watch.poll` used to run nvidia-smi inline (up to its 10 s timeout). Now probes run on
background threads; poll only picks up completed results. No wall-time assertions: the
probes block on Events and the probe timeout runs on a fake clock.
"""
from __future__ import annotations

import threading

import pytest

from unbroken.config import RunConfig
from unbroken.detect import HostSignals, ProbeResult
from unbroken.runtime.watch import Watch

pytestmark = pytest.mark.timeout(60)

SICK = ProbeResult(probe="fake-gpu", ok=False, problems=("GPU 0: 3 uncorrected ECC errors",))
HOST = HostSignals(load1=0.5, mem_available_gb=8.0, mem_total_gb=16.0, disk_free_gb=100.0)


class _Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict, threading.Thread]] = []

    def emit(self, kind: str, **fields) -> None:
        self.emitted.append((kind, fields, threading.current_thread()))

    def kinds(self) -> list[str]:
        return [k for k, _, _ in self.emitted]


class _BlockingProbe:
    """A GPU probe that blocks until released (a wedged nvidia-smi)."""

    name = "fake-gpu"
    skipped_reason = None

    def __init__(self) -> None:
        self.entered, self.release, self.calls = threading.Event(), threading.Event(), 0

    def probe(self) -> ProbeResult:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(30), "the test never released the probe"
        return SICK


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _watch(probe, events, **kw) -> Watch:
    return Watch(RunConfig(), node=0, nnodes=1, checkpoint_dir=".", events=events, host_every_s=0.0,
                 gpu_probe=probe, read_host=lambda _: HOST, **kw)


def _poll(w: Watch):
    return w.poll(None, [], lambda proc: None)


def test_poll_returns_while_the_probe_blocks_and_the_next_poll_sees_its_result():
    probe, events = _BlockingProbe(), _Events()
    w = _watch(probe, events)
    try:
        assert _poll(w) == []  # starts the probes and returns
        assert probe.entered.wait(10)
        assert _poll(w) == [] and not probe.release.is_set()  # returned while the probe is blocked
        assert probe.calls == 1  # no second call stacked behind the blocked one
        probe.release.set()
        assert w._gpu_sampler.join(10)
        found = _poll(w)
    finally:
        probe.release.set()
    assert [(f.fault, f.evidence["problems"]) for f, _ in found] == [("health", list(SICK.problems))]
    assert "host" in events.kinds()
    assert {t for _, _, t in events.emitted} == {threading.current_thread()}  # events on the polling thread


def test_a_probe_past_its_timeout_is_abandoned_with_one_warning_and_never_blocks_poll():
    probe, events, clock = _BlockingProbe(), _Events(), _Clock()
    w = _watch(probe, events, probe_timeout_s=15.0, clock=clock)
    try:
        _poll(w)
        assert probe.entered.wait(10)
        assert w._host_sampler.join(10)  # the host read (instant) has ended before the clock jumps
        clock.t = 15.0
        _poll(w)
        assert "warning" not in events.kinds()  # at its timeout, not past it
        clock.t = 16.0
        _poll(w)
        _poll(w)
        warnings = [f["message"] for k, f, _ in events.emitted if k == "warning"]
        assert len([m for m in warnings if "abandoned" in m]) == 1, warnings
        assert "fake-gpu probe on node 0" in warnings[0]
        assert probe.calls == 1  # a stuck probe is not started again on top of itself
        probe.release.set()
        assert w._gpu_sampler.join(10)
        assert _poll(w) == []  # the abandoned call's late result is dropped ...
        assert w._gpu_sampler.join(10)
        assert probe.calls == 2  # ... and the next round probes afresh
        assert [f.fault for f, _ in _poll(w)] == ["health"]
    finally:
        probe.release.set()


def test_a_host_reader_error_is_a_warning_not_a_crash_and_oserror_is_skipped():
    events = _Events()

    def boom(_):
        raise ValueError("bad meminfo")

    probe = _BlockingProbe()
    probe.release.set()
    w = Watch(RunConfig(), node=0, nnodes=1, checkpoint_dir=".", events=events, host_every_s=0.0,
              gpu_probe=probe, read_host=boom)
    _poll(w)
    assert w._host_sampler.join(10)
    _poll(w)
    assert any("bad meminfo" in f["message"] for k, f, _ in events.emitted if k == "warning")
    assert "host" not in events.kinds()
