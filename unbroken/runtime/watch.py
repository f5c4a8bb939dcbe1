"""The supervisor's watchdog: feeds `detect.Detector` and turns findings into decisions.

Every tick it reads its own processes' heartbeats from the store and the kernel's
process states; exits are fed as they are reaped. Each finding is classified (with the
per-node offender table) and returned with its decision; the supervisor records both
as events before it acts. Host signals and the GPU probe are sampled every
`host_every_s` on background threads (`_Sampler`): nvidia-smi may take 10 s, the loop never waits.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from unbroken.config import RunConfig
from unbroken.events import EventLog
from unbroken.detect import (Decision, Detector, DetectorConfig, ExclusionPolicy, Finding, HealthProbe,
                             Heartbeat, HostSignals, NvidiaSmiProbe, OffenderTable, classify, read_host_signals,
                             read_proc_state)
from unbroken.runtime import membership
from unbroken.runtime.procs import Child


class _Sampler:
    """Calls `fn` on a daemon thread, one call at a time; the owner collects the result later.

    A call running past `timeout_s` is abandoned (`overdue` says so once): its result, if it
    ever comes, is dropped, and no new call starts while it still holds its thread (a
    wedged probe never piles up threads)."""

    def __init__(self, name: str, fn: Callable[[], Any], *, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.timeout_s, self._fn, self._clock = name, timeout_s, fn, clock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._abandoned = False
        self._result: tuple[Any, BaseException | None] | None = None

    def start(self) -> bool:
        """Start a call unless one is still running (or stuck); True if one started."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return False
            self._thread = threading.Thread(target=self._run, name=f"unbroken-probe-{self.name}", daemon=True)
            self._started, self._abandoned = self._clock(), False
            self._thread.start()
            return True

    def _run(self) -> None:
        try:
            out: tuple[Any, BaseException | None] = (self._fn(), None)
        except Exception as e:  # noqa: BLE001 - handed to the owner with the result
            out = (None, e)
        with self._lock:
            if self._thread is threading.current_thread() and not self._abandoned:
                self._result = out

    def collect(self) -> tuple[Any, BaseException | None] | None:
        """The completed call's (value, error), once; None while nothing new has completed."""
        with self._lock:
            out, self._result = self._result, None
            return out

    def overdue(self) -> float | None:
        """Seconds the running call has taken, the first time it passes `timeout_s` (it is then
        abandoned); None otherwise."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive() or self._abandoned:
                return None
            took = self._clock() - self._started
            if took <= self.timeout_s:
                return None
            self._abandoned = True
            return took

    def join(self, timeout_s: float) -> bool:
        """Wait for the running call to end (tests); True when none is running."""
        t = self._thread
        if t is not None:
            t.join(timeout_s)
        return t is None or not t.is_alive()


class Watch:
    def __init__(self, cfg: RunConfig, *, node: int, nnodes: int, checkpoint_dir, events: EventLog,
                 host_every_s: float = 10.0, gpu_probe: HealthProbe | None = None,
                 read_host: Callable[[Any], HostSignals] = read_host_signals,
                 probe_timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.node, self.nnodes, self.checkpoint_dir, self.events = node, nnodes, checkpoint_dir, events
        self.detector = Detector(DetectorConfig(heartbeat_s=cfg.heartbeat_s,
                                                straggler_window_steps=cfg.straggler_window_steps))
        self.offenders = OffenderTable(ExclusionPolicy(max_faults=cfg.exclude_after_faults,
                                                       window_s=cfg.exclude_window_s))
        self.host_every_s = host_every_s
        self._next_host = 0.0
        probe = gpu_probe or NvidiaSmiProbe()
        # Past the probe's own timeout (nvidia-smi reports its own hang as a failed probe).
        timeout = probe_timeout_s or getattr(probe, "timeout_s", 10.0) + 5.0
        self._host_sampler = _Sampler("host", lambda: read_host(checkpoint_dir), timeout_s=timeout, clock=clock)
        self._gpu_sampler = _Sampler(probe.name, probe.probe, timeout_s=timeout, clock=clock)
        self._seen: dict[str, float] = {}  # proc -> time of the last heartbeat fed
        self._held = False  # hang detection was held at the last poll (a node's lease was late)

    def spawned(self, child: Child, rank: int | None) -> None:
        self.detector.expect(child.proc, rank, self.node, time.time())

    def exited(self, child: Child, rank: int | None, code: int) -> None:
        self.detector.observe_exit(child.proc, rank, self.node, code, time.time())

    def replaced(self, proc: str) -> None:
        self.detector.forget(proc)

    def recovered(self) -> None:
        self.detector.reset(time.time())

    def poll(self, store: dist.Store, children: list[Child], rank_of, *,
             hold_hangs: bool = False) -> list[tuple[Finding, Decision]]:
        now = time.time()
        states = {}
        for c in children:
            if c.reaped:
                continue
            states[c.proc] = read_proc_state(c.pid)
            hb = membership.get(store, f"hb/{c.proc}")
            if hb and hb["t"] > self._seen.get(c.proc, 0.0):
                self._seen[c.proc] = hb["t"]
                self.detector.observe(Heartbeat(proc=c.proc, rank=rank_of(c.proc), node=self.node,
                                                step=max(0, int(hb.get("step", 0))), phase=str(hb.get("phase", "")),
                                                time=hb["t"], step_s=hb.get("step_s"), wait_s=hb.get("wait_s")))
        self._host(now)
        if self._held and not hold_hangs:
            # the late node was declared lost (or came back): a rank that waited on it meanwhile
            # was not stalled; its no-progress deadline counts from now
            self.detector.restart_clocks(now)
        self._held = hold_hangs
        out = []
        for f in self.detector.check(now, states=states, hold_hangs=hold_hangs):
            d = classify(f, self.offenders, can_exclude=self.nnodes > 1 and f.node != 0)
            out.append((f, d))
        return out

    def _host(self, now: float) -> None:
        """Record the probes that completed since the last poll; start the next round when due."""
        self._collect_host(now)
        for sampler in (self._host_sampler, self._gpu_sampler):
            took = sampler.overdue()
            if took is not None:
                self.events.emit("warning", message=f"{sampler.name} probe on node {self.node} did not finish "
                                                    f"within {sampler.timeout_s:g} s ({took:.1f} s); abandoned")
        if now < self._next_host:
            return
        self._next_host = now + self.host_every_s
        self._host_sampler.start()
        self._gpu_sampler.start()

    def _collect_host(self, now: float) -> None:
        got = self._host_sampler.collect()
        if got is not None:
            signals, error = got
            if error is None:
                self.last_host = signals
                self.events.emit("host", **signals.event_fields())
                for message in self.detector.observe_host(self.node, signals):
                    self.events.emit("warning", message=message)
            elif not isinstance(error, OSError):  # an unreadable source is skipped, as a missing one
                self.events.emit("warning", message=f"host probe failed: {error!r}"[:300])
        got = self._gpu_sampler.collect()
        if got is not None:
            result, error = got
            if error is None:
                self.detector.observe_health(self.node, result, now)
            else:
                self.events.emit("warning", message=f"{self._gpu_sampler.name} probe raised: {error!r}"[:300])
