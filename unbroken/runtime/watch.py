"""The supervisor's watchdog: feeds `detect.Detector` and turns findings into decisions.

Every tick it reads its own processes' heartbeats from the store and the kernel's
process states; exits are fed as they are reaped. Each finding is classified (with the
per-node offender table) and returned with its decision; the supervisor records both
as events before it acts. Host signals are sampled every `host_every_s`.
"""
from __future__ import annotations

import time

import torch.distributed as dist

from unbroken.config import RunConfig
from unbroken.events import EventLog
from unbroken.detect import (Decision, Detector, DetectorConfig, ExclusionPolicy, Finding, Heartbeat,
                             NvidiaSmiProbe, OffenderTable, classify, read_host_signals, read_proc_state)
from unbroken.runtime import membership
from unbroken.runtime.procs import Child


class Watch:
    def __init__(self, cfg: RunConfig, *, node: int, nnodes: int, checkpoint_dir, events: EventLog,
                 host_every_s: float = 10.0) -> None:
        self.node, self.nnodes, self.checkpoint_dir, self.events = node, nnodes, checkpoint_dir, events
        self.detector = Detector(DetectorConfig(heartbeat_s=cfg.heartbeat_s,
                                                straggler_window_steps=cfg.straggler_window_steps))
        self.offenders = OffenderTable(ExclusionPolicy(max_faults=cfg.exclude_after_faults,
                                                       window_s=cfg.exclude_window_s))
        self.host_every_s = host_every_s
        self._next_host = 0.0
        self._probe = NvidiaSmiProbe()
        self._seen: dict[str, float] = {}  # proc -> time of the last heartbeat fed

    def spawned(self, child: Child, rank: int | None) -> None:
        self.detector.expect(child.proc, rank, self.node, time.time())

    def exited(self, child: Child, rank: int | None, code: int) -> None:
        self.detector.observe_exit(child.proc, rank, self.node, code, time.time())

    def replaced(self, proc: str) -> None:
        self.detector.forget(proc)

    def recovered(self) -> None:
        self.detector.reset(time.time())

    def poll(self, store: dist.Store, children: list[Child], rank_of) -> list[tuple[Finding, Decision]]:
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
        out = []
        for f in self.detector.check(now, states=states):
            d = classify(f, self.offenders, can_exclude=self.nnodes > 1 and f.node != 0)
            out.append((f, d))
        return out

    def _host(self, now: float) -> None:
        if now < self._next_host:
            return
        self._next_host = now + self.host_every_s
        try:
            self.last_host = read_host_signals(self.checkpoint_dir)
        except OSError:
            return
        self.events.emit("host", **self.last_host.event_fields())
        for message in self.detector.observe_host(self.node, self.last_host):
            self.events.emit("warning", message=message)
        self.detector.observe_health(self.node, self._probe.probe(), now)
