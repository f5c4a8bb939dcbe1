"""Fault detectors: turn heartbeats, exits and probes into `Finding`s with their evidence.

The supervisor feeds a `Detector` and polls `check(now)`; the worker calls the pure
`numerics_check` itself. Thresholds live in `DetectorConfig` (documented in docs/detect.md).
"""
from __future__ import annotations

import math
import signal
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from unbroken.detect.signals import Heartbeat, HostSignals, ProbeResult

FAULTS = ("crash", "hang", "exception", "numerics", "straggler", "stall", "health", "node_lost")
COLLECTIVE_PHASES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "collective")
IDLE_PHASES = ("standby", "done")
# Kernel process states that mean "will not run": stopped / traced.
_STOPPED = ("T", "t")
_GONE = ("Z", "X", "x")


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One detector decision: which fault, where, when, and the evidence that triggered it."""

    fault: str
    proc: str
    rank: int | None
    node: int | None
    time: float
    evidence: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"Finding.fault must be one of {', '.join(FAULTS)}, got {self.fault!r}")

    def event_fields(self) -> dict[str, Any]:
        """Fields of the `fault_detected` event (pass `rank=finding.rank` to `emit`)."""
        return {"fault": self.fault, "proc": self.proc, "node": self.node, "evidence": self.evidence}


def _positive(name: str, v: float, hint: str) -> None:
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
        raise ValueError(f"DetectorConfig.{name} must be a number > 0, got {v!r}; {hint}")


@dataclass(frozen=True, kw_only=True)
class DetectorConfig:
    """Detection thresholds. Each is explained, with its reasoning, in docs/detect.md."""

    heartbeat_s: float = 0.1                 # interval at which workers publish heartbeats
    silence_heartbeats: float = 1.5          # hang if silent this many intervals (stopped or state unknown)
    running_silence_heartbeats: float = 20.0  # ... when the kernel says the process is still running
    min_deadline_s: float = 2.0              # floor of the no-progress deadline
    deadline_factor: float = 5.0             # no-progress deadline = factor x p99 step time
    startup_deadline_s: float = 300.0        # deadline before any step time is known (imports, compile)
    phase_deadlines_s: tuple[tuple[str, float], ...] = (("init", 300.0), ("checkpoint", 300.0),
                                                        ("recovery", 120.0))
    collective_phases: tuple[str, ...] = COLLECTIVE_PHASES
    idle_phases: tuple[str, ...] = IDLE_PHASES  # no progress expected (a waiting shadow): silence only
    step_history: int = 200                  # pooled step times kept for the p99
    straggler_factor: float = 1.5            # busy time >= factor x peers' median ...
    straggler_min_gap_s: float = 0.01        # ... and at least this much slower per step ...
    straggler_window_steps: int = 10         # ... judged per window of this many steps ...
    straggler_windows: int = 3               # ... in this many consecutive windows
    spike_factor: float = 10.0               # grad norm > factor x running median is a spike
    spike_window: int = 100                  # grad norms in the running median
    spike_min_history: int = 20              # no spike verdict before this many norms
    min_disk_free_gb: float = 1.0            # warn below this free space for checkpoints
    min_mem_available_frac: float = 0.05     # warn below this fraction of memory available

    def __post_init__(self) -> None:
        _positive("heartbeat_s", self.heartbeat_s, "e.g. 0.1 (seconds between heartbeats)")
        for name in ("min_deadline_s", "deadline_factor", "startup_deadline_s", "straggler_factor",
                     "spike_factor", "min_disk_free_gb"):
            _positive(name, getattr(self, name), "see docs/detect.md for the default and its reason")
        if not self.silence_heartbeats >= 1.0:
            raise ValueError(f"DetectorConfig.silence_heartbeats must be >= 1 (a heartbeat can't come "
                             f"early), got {self.silence_heartbeats!r}; e.g. 1.5")
        if not self.running_silence_heartbeats >= self.silence_heartbeats:
            raise ValueError(f"DetectorConfig.running_silence_heartbeats ({self.running_silence_heartbeats!r}) "
                             f"must be >= silence_heartbeats ({self.silence_heartbeats!r})")
        if not self.straggler_factor > 1.0:
            raise ValueError(f"DetectorConfig.straggler_factor must be > 1 (a ratio to the median), "
                             f"got {self.straggler_factor!r}; e.g. 1.5")
        if not self.straggler_min_gap_s >= 0:
            raise ValueError(f"DetectorConfig.straggler_min_gap_s must be >= 0, got {self.straggler_min_gap_s!r}")
        if not 0 <= self.min_mem_available_frac < 1:
            raise ValueError(f"DetectorConfig.min_mem_available_frac must be in [0, 1), "
                             f"got {self.min_mem_available_frac!r}; e.g. 0.05")
        for name in ("step_history", "straggler_window_steps", "straggler_windows", "spike_window",
                     "spike_min_history"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"DetectorConfig.{name} must be an integer >= 1, got {v!r}")
        if self.spike_min_history > self.spike_window:
            raise ValueError(f"DetectorConfig.spike_min_history ({self.spike_min_history}) must be <= "
                             f"spike_window ({self.spike_window})")
        for entry in self.phase_deadlines_s:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                    and isinstance(entry[1], (int, float)) and entry[1] > 0):
                raise ValueError(f"DetectorConfig.phase_deadlines_s entries must be (phase, seconds > 0), "
                                 f"got {entry!r}; e.g. (('checkpoint', 300.0),)")


def _r(x: float) -> float:
    return round(float(x), 4)


def _p99(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]


def exit_evidence(returncode: int) -> tuple[str, dict[str, Any]]:
    """Classify a non-zero exit status: killed by a signal is a crash, anything else an exception.

    A negative code is Popen's "killed by signal -code"; 128+N is a shell reporting signal N.
    """
    assert returncode != 0, "a clean exit is not a fault"
    sig = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 160 else 0
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return "crash", {"returncode": returncode, "signal": name}
    return "exception", {"returncode": returncode}


def numerics_check(loss: float | None, grad_norm: float | None, history: Sequence[float], *,
                   config: DetectorConfig | None = None, proc: str = "", rank: int | None = None,
                   node: int | None = None, step: int | None = None,
                   now: float = 0.0) -> Finding | None:
    """Judge one step's loss and gradient norm against the recent finite norms in `history`.

    Pure: the caller appends `grad_norm` to its history afterwards (only if this returns None).
    Non-finite loss or gradient norm, or a norm above `spike_factor` x the running median,
    is a `numerics` finding.
    """
    cfg = config or DetectorConfig()
    ev: dict[str, Any] = {"step": step, "loss": _num_text(loss), "grad_norm": _num_text(grad_norm)}
    if loss is not None and not math.isfinite(loss):
        ev["what"] = "loss_nonfinite"
    elif grad_norm is not None and not math.isfinite(grad_norm):
        ev["what"] = "grad_nonfinite"
    else:
        recent = [h for h in list(history)[-cfg.spike_window:] if math.isfinite(h)]
        if grad_norm is None or len(recent) < cfg.spike_min_history:
            return None
        median = statistics.median(recent)
        if not (median > 0 and grad_norm > cfg.spike_factor * median):
            return None
        ev.update(what="grad_spike", ratio=_r(grad_norm / median), median=_r(median),
                  factor=cfg.spike_factor, window=len(recent))
    return Finding(fault="numerics", proc=proc, rank=rank, node=node, time=now, evidence=ev)


def _num_text(x: float | None) -> float | str | None:
    # JSON has no NaN/Infinity: keep them readable as text.
    if x is None:
        return None
    return _r(x) if math.isfinite(x) else str(x)


def host_warnings(signals: HostSignals, config: DetectorConfig) -> dict[str, str]:
    """Host conditions worth a `warning` event (not faults: they do not point at a rank)."""
    out: dict[str, str] = {}
    if signals.disk_free_gb is not None and signals.disk_free_gb < config.min_disk_free_gb:
        out["disk"] = (f"checkpoint directory has {signals.disk_free_gb:.2f} GB free, below "
                       f"{config.min_disk_free_gb:g} GB: free space or point checkpoints elsewhere")
    avail, total = signals.mem_available_gb, signals.mem_total_gb
    if avail is not None and total and avail / total < config.min_mem_available_frac:
        out["memory"] = (f"only {avail:.2f} of {total:.2f} GB memory available "
                         f"(< {config.min_mem_available_frac:.0%}): risk of the OOM killer")
    return out


@dataclass(slots=True)
class _Proc:
    """What the detector knows about one watched process."""

    proc: str
    rank: int | None
    node: int
    last_seen: float
    step: int
    phase: str
    progress_at: float
    exited: bool = False
    heard: bool = True            # False until the first heartbeat of a process registered by `expect`
    incident: str | None = None   # open finding; no new findings until reset/forget
    samples: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (busy, wait)


class Detector:
    """Stateful detector the supervisor feeds with heartbeats, exits and probes.

    Each process has at most one open incident: once flagged it yields no further
    findings (its SIGKILL by the watchdog is not a second crash) until `reset(now)`
    after a recovery, or `forget(proc)` when it is replaced.
    """

    def __init__(self, config: DetectorConfig | None = None) -> None:
        self.config = config or DetectorConfig()
        self._procs: dict[str, _Proc] = {}
        self._pending: list[Finding] = []
        self._step_times: deque[float] = deque(maxlen=self.config.step_history)
        self._p99: float | None = None     # cached p99 of _step_times; None = recompute
        self._window = 0                   # next straggler window to judge
        self._strikes: dict[str, int] = {}
        self._straggling: set[str] = set()
        self._host: dict[int, HostSignals] = {}
        self._latched: set[tuple[int, str]] = set()   # (node, host/health condition) already reported

    # --- feeding -------------------------------------------------------------------------
    def observe(self, hb: Heartbeat) -> None:
        p = self._procs.get(hb.proc)
        if p is None:
            p = self._procs[hb.proc] = _Proc(proc=hb.proc, rank=hb.rank, node=hb.node, last_seen=hb.time,
                                             step=hb.step, phase=hb.phase, progress_at=hb.time)
        elif p.exited or (p.heard and hb.time < p.last_seen):
            return  # a late or reordered heartbeat carries no news
        p.heard = True
        if (hb.step, hb.phase) != (p.step, p.phase):
            p.progress_at = hb.time
        p.rank, p.node, p.last_seen, p.step, p.phase = hb.rank, hb.node, hb.time, hb.step, hb.phase
        if hb.step_s is not None and hb.step >= 1 and (hb.step - 1) not in p.samples:
            p.samples[hb.step - 1] = (hb.busy_s or 0.0, hb.wait_s or 0.0)
            self._step_times.append(hb.step_s)
            self._p99 = None

    def expect(self, proc: str, rank: int | None, node: int, now: float) -> None:
        """Watch `proc` from its spawn: until its first heartbeat it is in phase 'init'
        (the fixed init deadline applies; no silence verdict while Python and torch load)."""
        self._procs[proc] = _Proc(proc=proc, rank=rank, node=node, last_seen=now, step=0, phase="init",
                                  progress_at=now, heard=False)

    def observe_exit(self, proc: str, rank: int | None, node: int, returncode: int, time: float) -> None:
        """A process ended. Non-zero exits become crash/exception findings at the next `check`."""
        p = self._procs.get(proc)
        if p is None:
            p = self._procs[proc] = _Proc(proc=proc, rank=rank, node=node, last_seen=time,
                                          step=0, phase="", progress_at=time)
        p.exited = True
        if returncode == 0 or p.incident is not None:
            return
        fault, ev = exit_evidence(returncode)
        ev.update(phase=p.phase, step=p.step, last_heartbeat_age_s=_r(time - p.last_seen))
        p.incident = fault
        self._pending.append(self._finding(fault, p, time, ev))

    def observe_health(self, node: int, result: ProbeResult | None, time: float, *, proc: str = "") -> None:
        """A GPU health probe result for `node` (None = probe skipped). A failure is a finding once."""
        if result is None:
            return
        key = (node, "health")
        if result.ok:
            self._latched.discard(key)
        elif key not in self._latched:
            self._latched.add(key)
            ev = {"probe": result.probe, "problems": list(result.problems)}
            self._pending.append(Finding(fault="health", proc=proc or f"node{node}", rank=None,
                                         node=node, time=time, evidence=ev))

    def observe_host(self, node: int, signals: HostSignals) -> list[str]:
        """Keep the node's host signals (attached as evidence) and return newly crossed warnings."""
        self._host[node] = signals
        warnings = host_warnings(signals, self.config)
        for cond in ("disk", "memory"):
            if cond not in warnings:
                self._latched.discard((node, cond))
        new = [msg for cond, msg in warnings.items() if (node, cond) not in self._latched]
        self._latched.update((node, cond) for cond in warnings)
        return new

    # --- lifecycle -----------------------------------------------------------------------
    def reset(self, now: float) -> None:
        """After a recovery: close open incidents, restart deadlines and straggler windows."""
        for p in self._procs.values():
            p.incident = None
            p.progress_at = now
            p.last_seen = max(p.last_seen, now)
            p.samples.clear()
        self._window = 0
        self._strikes.clear()
        self._straggling.clear()

    def restart_clocks(self, now: float) -> None:
        """A wait explained elsewhere has ended (a late node's lease decided): every no-progress
        deadline counts from `now`; open incidents stay open."""
        for p in self._procs.values():
            p.progress_at = max(p.progress_at, now)

    def forget(self, proc: str) -> None:
        """Stop watching `proc` (replaced or excluded)."""
        self._procs.pop(proc, None)
        self._strikes.pop(proc, None)
        self._straggling.discard(proc)

    def watching(self) -> list[str]:
        return [p.proc for p in self._procs.values() if not p.exited]

    # --- deciding ------------------------------------------------------------------------
    def deadline(self, phase: str) -> tuple[float, str]:
        """The no-progress deadline for `phase` and how it was derived."""
        fixed = dict(self.config.phase_deadlines_s)
        if phase in fixed:
            return float(fixed[phase]), f"fixed deadline for phase {phase!r}"
        if not self._step_times:
            return self.config.startup_deadline_s, "startup deadline (no step time observed yet)"
        if self._p99 is None:
            self._p99 = _p99(self._step_times)
        p99 = self._p99
        derived = self.config.deadline_factor * p99
        if derived <= self.config.min_deadline_s:
            return self.config.min_deadline_s, f"floor (p99 step time {p99:.4f} s)"
        return derived, f"{self.config.deadline_factor:g} x p99 step time {p99:.4f} s"

    def check(self, now: float, states: Mapping[str, str | None] | None = None, *,
              hold_hangs: bool = False) -> list[Finding]:
        """Findings since the last call. `states` maps proc -> kernel state letter
        (`signals.read_proc_state`) where the supervisor can see the process. `hold_hangs`:
        judge no hang or stall now (another node has gone quiet: waiting on it is not a hang
        here); the clocks keep running, so a real one is found once the hold ends."""
        out, self._pending = self._pending, []
        if not hold_hangs:
            out += self._hang_findings(now, states or {})
        out += self._straggler_findings(now)
        return out

    def _live(self) -> list[_Proc]:
        return [p for p in self._procs.values() if not p.exited and p.incident is None]

    def _finding(self, fault: str, p: _Proc, time: float, ev: dict[str, Any]) -> Finding:
        host = self._host.get(p.node)
        if host is not None:
            ev["host"] = {k: (None if v is None else _r(v)) for k, v in host.event_fields().items()}
        return Finding(fault=fault, proc=p.proc, rank=p.rank, node=p.node, time=time, evidence=ev)

    def _silence(self, p: _Proc, now: float, state: str | None) -> Finding | None:
        if state in _GONE or not p.heard:
            return None  # dead (its exit status is the better evidence), or not started yet
        if p.phase == "done" and state not in _STOPPED:
            return None  # finished: it stops beating as it exits; its exit status tells the rest
        n = (self.config.running_silence_heartbeats if state is not None and state not in _STOPPED
             else self.config.silence_heartbeats)
        limit, age = n * self.config.heartbeat_s, now - p.last_seen
        if age <= limit:
            return None
        return self._finding("hang", p, now, {
            "why": "heartbeat silence", "last_heartbeat_age_s": _r(age), "silence_limit_s": _r(limit),
            "proc_state": state, "phase": p.phase, "step": p.step})

    def _hang_findings(self, now: float, states: Mapping[str, str | None]) -> list[Finding]:
        found: list[Finding] = []
        waiters: list[tuple[_Proc, float, float, str]] = []
        live = self._live()
        in_collective = sorted(q.rank for q in live if q.phase in self.config.collective_phases
                               and q.rank is not None)
        for p in live:
            f = self._silence(p, now, states.get(p.proc))
            limit, basis = self.deadline(p.phase)
            stuck = now - p.progress_at
            if f is None and stuck > limit and p.phase not in self.config.idle_phases:
                if p.phase in self.config.collective_phases:
                    waiters.append((p, stuck, limit, basis))
                    continue
                f = self._finding("hang", p, now, {
                    "why": "no progress", "phase": p.phase, "step": p.step, "no_progress_s": _r(stuck),
                    "deadline_s": _r(limit), "deadline_basis": basis, "ranks_in_collective": in_collective})
            if f is not None:
                p.incident = "hang"
                found.append(f)
        if waiters and not any(q.incident for q in self._procs.values()):
            found.append(self._stall(waiters, now))
        return found

    def _stall(self, waiters: list[tuple[_Proc, float, float, str]], now: float) -> Finding:
        # Everyone stuck is inside a collective and nobody outside it is to blame: the
        # link or the collective itself is stuck. One finding for the group.
        procs = [w[0] for w in waiters]
        for p in procs:
            p.incident = "stall"
        nodes = {p.node for p in procs}
        first, stuck, limit, basis = max(waiters, key=lambda w: w[1])
        ev = {"why": "no progress inside a collective", "phase": first.phase, "step": first.step,
              "no_progress_s": _r(stuck), "deadline_s": _r(limit), "deadline_basis": basis,
              "ranks": sorted(p.rank for p in procs if p.rank is not None)}
        one = procs[0] if len(procs) == 1 else None
        return Finding(fault="stall", proc=one.proc if one else "group", rank=one.rank if one else None,
                       node=nodes.pop() if len(nodes) == 1 else None, time=now, evidence=ev)

    def _straggler_findings(self, now: float) -> list[Finding]:
        live = [p for p in self._live() if p.rank is not None]
        if len(live) < 2:
            return []
        size = self.config.straggler_window_steps
        done = min(p.step for p in live)  # every live rank has completed the steps before this
        sampled = [s for p in live for s in p.samples]
        if not sampled:
            return []
        self._window = max(self._window, min(sampled) // size)  # skip windows nobody sampled
        out: list[Finding] = []
        while (self._window + 1) * size <= done:
            out += self._judge_window(self._window, live, now)
            self._window += 1
        for p in live:
            for s in [s for s in p.samples if s < self._window * size]:
                del p.samples[s]
        return out

    def _judge_window(self, w: int, live: list[_Proc], now: float) -> list[Finding]:
        cfg, size = self.config, self.config.straggler_window_steps
        meds: dict[str, tuple[float, float]] = {}
        for p in live:
            xs = [v for s, v in p.samples.items() if w * size <= s < (w + 1) * size]
            if xs:
                meds[p.proc] = (statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs))
        if len(meds) < 2:
            return []
        out = []
        for p in live:
            if p.proc not in meds:
                continue  # no sample in this window: no news either way
            busy, wait = meds[p.proc]
            peers = [meds[q][0] for q in meds if q != p.proc]
            ref = statistics.median(peers)
            slow = ref > 0 and busy >= cfg.straggler_factor * ref and busy - ref >= cfg.straggler_min_gap_s
            if not slow:
                self._strikes[p.proc] = 0
                self._straggling.discard(p.proc)
                continue
            self._strikes[p.proc] = self._strikes.get(p.proc, 0) + 1
            if self._strikes[p.proc] >= cfg.straggler_windows and p.proc not in self._straggling:
                self._straggling.add(p.proc)
                peer_wait = statistics.median(meds[q][1] for q in meds if q != p.proc)
                out.append(self._finding("straggler", p, now, {
                    "ratio": _r(busy / ref), "busy_s": _r(busy), "median_s": _r(ref),
                    "wait_s": _r(wait), "peers_wait_s": _r(peer_wait), "factor": cfg.straggler_factor,
                    "windows": self._strikes[p.proc], "window_steps": size,
                    "steps": [(w + 1 - self._strikes[p.proc]) * size, (w + 1) * size - 1]}))
        return out
