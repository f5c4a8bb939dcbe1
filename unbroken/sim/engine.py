"""The event loop: walks one failure trace through one resolved policy and accounts every wall second.

wall = productive + overhead + redo + checkpoint + detect + decide + wait + regroup + rebuild + degraded.
Work between failures is advanced in closed form (no per-step or per-GPU loop). Kept compute
is split at the end: with the policy's failure-free overhead o, productive = kept / (1 + o)
and overhead = kept - productive, so ETTR = productive / wall is net of the policy's own cost.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from unbroken.sim.cluster import Cluster, SparePool, Trace, make_trace
from unbroken.sim.policies import Policy, Resolved, Scale, Schedule, tier2_mttf_s
from unbroken.sim.costs import Workload
from unbroken.sim.rates import FailureClass, FailureMix

RECOVERY_PHASES = ("detect", "decide", "wait", "regroup", "rebuild", "degraded")
ACCOUNTS = ("productive", "overhead", "redo", "checkpoint") + RECOVERY_PHASES


class _Grid:
    """Maps wall time since a resume to progress and the last completed fast and slow saves."""

    def __init__(self, s: Schedule) -> None:
        self.tau, self.m = s.fast_interval_s, s.slow_every
        self.seg = self.tau + s.fast_cost_s  # a fast segment: compute, then a fast save
        self.cycle = (self.m - 1) * self.seg + self.tau + s.slow_cost_s  # ... the last one saves persistently

    def locate(self, i0: int, dt: float) -> tuple[float, int, int]:
        """Resumed at fast index i0 `dt` seconds ago: (progress, last fast index saved, last slow index saved)."""
        j0 = i0 % self.m
        a = j0 * self.seg + dt
        k = int(a // self.cycle)
        w = a - k * self.cycle
        j = min(int(w // self.seg), self.m - 1)
        w -= j * self.seg
        base = i0 - j0 + k * self.m
        seg = base + j
        p = seg * self.tau + w if w < self.tau else (seg + 1) * self.tau
        return p, seg, base


@dataclass
class Incident:
    """One recovery, possibly absorbing more faults that strike while it runs."""

    start: float
    tier: str
    p_fail: float
    restore: int
    groups: set[int]
    faults: list[tuple[float, int, int, int, str]] = field(default_factory=list)
    plan: list[tuple[str, float]] = field(default_factory=list)
    plan_start: float = 0.0
    end: float = 0.0
    done: list[tuple[str, float, float]] = field(default_factory=list)
    finished: bool = False


@dataclass(frozen=True)
class RunResult:
    """One seeded run of one policy: totals per account (seconds) and, if recorded, the incidents.

    `overhead`: the policy's failure-free overhead fraction; `failure_free_overhead` adds its
    blocking saves, (1 + overhead)(1 + save share) - 1.
    """

    policy: str
    gpus: int
    days: float
    seed: int
    failures: int
    tier2: int
    time_s: dict[str, float]
    step_s: float
    fast_interval_s: float
    incidents: tuple[Incident, ...] = ()
    overhead: float = 0.0
    failure_free_overhead: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.days * 86400.0

    @property
    def ettr(self) -> float:
        """Net ETTR: productive time, net of the policy's failure-free overhead, over wall time."""
        return self.time_s["productive"] / self.wall_s

    @property
    def ettr_gross(self) -> float:
        """ETTR before the overhead is taken out: kept compute over wall time (= ettr at overhead 0)."""
        return (self.time_s["productive"] + self.time_s["overhead"]) / self.wall_s


class _Run:
    """Mutable state of one run; `run_policy` is the only user."""

    def __init__(self, res: Resolved, cluster: Cluster, classes: tuple[FailureClass, ...], record: bool) -> None:
        self.res, self.classes, self.record = res, classes, record
        self.grid = _Grid(res.schedule)
        self.acc = dict.fromkeys(ACCOUNTS, 0.0)
        self.spares = SparePool(cluster.spare_nodes, cluster.repair_h * 3600.0, cluster.provision_s)
        self.n_groups = max(1, cluster.nodes // res.guard_nodes) if res.guard_nodes else 0
        self.run_t, self.run_i, self.slow_i = 0.0, 0, 0
        self.computed = 0.0
        self.busy: Incident | None = None
        self.incidents: list[Incident] = []
        self.tier2 = 0

    def advance(self, t: float) -> tuple[float, int]:
        """Account steady running from the last resume to t; returns (progress, last fast save)."""
        p, fast_i, slow_i = self.grid.locate(self.run_i, t - self.run_t)
        comp = p - self.run_i * self.grid.tau
        self.computed += comp
        self.acc["checkpoint"] += (t - self.run_t) - comp
        self.slow_i = max(self.slow_i, slow_i)
        return p, fast_i

    def on_fault(self, t: float, ci: int, node: int, gpu: int) -> None:
        if self.busy is not None and t >= self.busy.end:
            self.finish()
        c = self.classes[ci]
        wait = self.spares.take(t) if c.kind == "replace" else 0.0
        group = node % self.n_groups if self.n_groups else -1
        if self.busy is None:
            p, fast_i = self.advance(t)
            tier2 = c.corrupts_state or self.res.path == "tier2"
            restore = self.slow_i if tier2 else fast_i
            self.acc["redo"] += p - restore * self.grid.tau
            self.busy = Incident(start=t, tier="tier2" if tier2 else self.res.path, p_fail=p,
                                 restore=restore, groups={group})
            carried: list[tuple[str, float]] = []
        else:
            inc = self.busy
            carried = self.run_phases(inc, t)
            if inc.tier != "tier2" and (c.corrupts_state or (self.n_groups and group in inc.groups)):
                inc.tier = "tier2"
                self.acc["redo"] += (inc.restore - self.slow_i) * self.grid.tau
                inc.restore = self.slow_i
            inc.groups.add(group)
        self.plan(t, wait, carried)
        if self.record:
            action = "tier2" if self.busy.tier == "tier2" else ("exclude_node" if c.kind == "replace" else "in_place")
            self.busy.faults.append((t, ci, node, gpu, action))

    def plan(self, t: float, wait: float, carried: list[tuple[str, float]]) -> None:
        inc = self.busy
        assert inc is not None
        phases = list(self.res.tier2 if inc.tier == "tier2" else self.res.tier1)
        if wait > 0 and inc.tier != "tier2" and self.res.wait_share < 1.0:  # the others keep training
            carried, wait = carried + [("degraded", wait * self.res.wait_share)], 0.0
        wait = max([wait] + [d for n, d in carried if n == "wait"])  # nodes are sought in parallel
        carried = [(n, d) for n, d in carried if n != "wait"]
        if wait > 0:
            at = next((i + 1 for i, (n, _) in enumerate(phases) if n == "decide"), 0)
            phases.insert(at, ("wait", wait))
        inc.plan = phases + carried
        inc.plan_start = t
        inc.end = t + sum(d for _, d in inc.plan)

    def run_phases(self, inc: Incident, until: float) -> list[tuple[str, float]]:
        """Account the plan's phases up to `until`; return what is left of phases a new fault cannot
        cancel (waiting for a node, and the policy's `carry`)."""
        s, left = inc.plan_start, []
        for name, d in inc.plan:
            ran = min(d, max(0.0, until - s))
            self.acc[name] += ran
            if self.record and ran > 0:
                inc.done.append((name, s, s + ran))
            if d - ran > 0 and (name == "wait" or name in self.res.carry):
                left.append((name, d - ran))
            s += d
        return left

    def finish(self) -> None:
        inc = self.busy
        assert inc is not None
        self.run_phases(inc, inc.end)
        inc.finished = True
        self.run_t, self.run_i = inc.end, inc.restore
        self.tier2 += inc.tier == "tier2"
        self.busy = None
        if self.record:
            self.incidents.append(inc)

    def close(self, horizon: float) -> None:
        if self.busy is not None and self.busy.end <= horizon:
            self.finish()
        if self.busy is None:
            self.advance(horizon)
        else:
            self.run_phases(self.busy, horizon)
            if self.record:
                self.incidents.append(self.busy)
        kept = self.computed - self.acc["redo"]
        self.acc["productive"] = kept / (1.0 + self.res.overhead)
        self.acc["overhead"] = kept - self.acc["productive"]


def resolve(policy: Policy, cluster: Cluster, mix: FailureMix, workload: Workload) -> Resolved:
    """The policy's schedule and phases at this cluster's size and failure rates."""
    mttf_s = mix.mttf_hours(cluster.gpus) * 3600.0
    share = sum(c.count for c in mix.classes if c.corrupts_state) / mix.total
    return policy.resolve(Scale(gpus=cluster.gpus, nodes=cluster.nodes, mttf_s=mttf_s,
                                tier2_mttf_s=tier2_mttf_s(mttf_s, share), workload=workload))


def run_policy(policy: Policy, cluster: Cluster, mix: FailureMix, workload: Workload, seed: int, *,
               trace: Trace | None = None, record: bool = False) -> RunResult:
    """Simulate one seeded run; `trace` lets callers share one failure trace across policies."""
    res = resolve(policy, cluster, mix, workload)
    trace = make_trace(cluster, mix, seed) if trace is None else trace
    run = _Run(res, cluster, mix.classes, record)
    for t, ci, node, gpu in zip(trace.times.tolist(), trace.cls.tolist(), trace.node.tolist(), trace.gpu.tolist()):
        run.on_fault(t, ci, node, gpu)
    run.close(cluster.horizon_s)
    return RunResult(policy=res.name, gpus=cluster.gpus, days=cluster.days, seed=seed, failures=len(trace),
                     tier2=run.tier2, time_s=run.acc, step_s=workload.step_s,
                     fast_interval_s=res.schedule.fast_interval_s, incidents=tuple(run.incidents),
                     overhead=res.overhead, failure_free_overhead=res.failure_free_overhead)
