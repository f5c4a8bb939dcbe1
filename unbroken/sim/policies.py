"""The four recovery policies, each resolved at a cluster size into a schedule and recovery phases.

`Resolved` is all the engine needs: when state is saved (two tiers), which phases a
failure costs on the fast path (tier 1) and on the persistent-checkpoint path (tier 2),
and the policy's failure-free `overhead`: the fraction of every step's time it costs when
nothing fails, beyond the saves its schedule simulates (the engine divides productive
time by 1 + overhead; docs/simulator.md, "Failure-free overhead").
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Union

from unbroken.sim.costs import (JobRestart, Phases, Workload, _non_negative, _positive, daly_interval,
                                log2_scale)
from unbroken.sim.errors import SimError, need

POLICY_NAMES = ("ckpt-restart", "in-memory", "replica-heal", "unbroken")
MAX_TIER2_INTERVAL_S = 86400.0

# Failure-free overhead defaults: fraction of every step's time, on top of the saves the schedule
# simulates. Sources (docs/simulator.md, "Failure-free overhead"):
# ckpt-restart: 0 here, because its failure-free cost IS its simulated blocking checkpoint, C = state /
#   storage every Young (1974) / Daly (2006) interval (the checkpoint-stall model of costs.py; C/tau is
#   3.9% at 16k and 11.7% at 131k with the defaults); counting it again here would charge it twice.
CKPT_RESTART_OVERHEAD = 0.0
# in-memory: Gemini (Wang et al., SOSP'23) reports that checkpointing to CPU memory every iteration
#   "incurs no overhead on training throughput" (abstract; its traffic scheduling interleaves the copies
#   with training traffic). We take that published figure as is: 0.
GEMINI_OVERHEAD = 0.0
# replica-heal: OUR MODELLING CHOICE, no published figure for torchft over NCCL at scale: 2% for the
#   per-step quorum (torchft overlaps it with backward) and the fault-tolerant cross-replica all-reduce.
#   A vendor benchmark (Clockwork, 64 H200, torchft with Gloo across replicas) saw far more.
REPLICA_HEAL_OVERHEAD = 0.02
# unbroken, uncalibrated: 0.16, about the tier-1 + tier-2 step overhead measured on main before
#   amortized protection (bench/results/protect.json: +14.8% median, +19.0% mean per step;
#   throughput.json: 1/0.839 - 1 = +19% at 4 ranks). `--calibrate` replaces it from overhead.json.
UNCALIBRATED_OVERHEAD = 0.16
OVERHEAD_SOURCES = {
    "ckpt-restart": "0: its cost is the simulated blocking checkpoint (state / storage every Young/Daly "
                    "interval), reported as save share",
    "in-memory": "Gemini (Wang et al., SOSP'23): per-iteration in-memory checkpoints with no throughput "
                 "overhead",
    "replica-heal": "modelling choice (no published torchft figure over NCCL): per-step quorum + "
                    "fault-tolerant cross-replica all-reduce",
    "unbroken": "uncalibrated default: the cost measured on main before amortized protection",
}
DEFAULT_OVERHEAD = {"ckpt-restart": CKPT_RESTART_OVERHEAD, "in-memory": GEMINI_OVERHEAD,
                    "replica-heal": REPLICA_HEAL_OVERHEAD, "unbroken": UNCALIBRATED_OVERHEAD}


def check_overhead(owner: str, v: object) -> None:
    """A failure-free overhead is a fraction of step time in [0, 1)."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1
    need(ok, f"{owner} must be a fraction in [0, 1) of step time (e.g. 0.05 for 5%), got {v!r}")


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Steady state: a fast save every `fast_interval_s` of compute; every `slow_every`-th is persistent."""

    fast_interval_s: float
    fast_cost_s: float
    slow_every: int
    slow_cost_s: float

    def __post_init__(self) -> None:
        assert self.fast_interval_s > 0 and self.slow_every >= 1, self
        assert self.fast_cost_s >= 0 and self.slow_cost_s >= 0, self

    @property
    def slow_interval_s(self) -> float:
        return self.fast_interval_s * self.slow_every

    @property
    def save_share(self) -> float:
        """Blocking save seconds per compute second when nothing fails."""
        saves = (self.slow_every - 1) * self.fast_cost_s + self.slow_cost_s
        return saves / self.slow_interval_s


@dataclass(frozen=True, kw_only=True)
class Scale:
    """Where a policy is resolved: cluster size, failure rates and workload."""

    gpus: int
    nodes: int
    mttf_s: float
    tier2_mttf_s: float
    workload: Workload


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """A policy at one scale. `guard_nodes` > 0: a second failure in the same group of that
    many nodes during a recovery forces tier 2. `carry`: phases a later failure does not cancel.
    `wait_share` < 1: waiting for a replacement node only slows the job (charged as `degraded`)."""

    name: str
    schedule: Schedule
    tier1: Phases
    tier2: Phases
    path: str
    guard_nodes: int = 0
    carry: frozenset[str] = frozenset()
    wait_share: float = 1.0
    overhead: float = 0.0

    @property
    def failure_free_overhead(self) -> float:
        """All a failure-free step costs: the overhead and the blocking saves, (1 + o)(1 + s) - 1."""
        return (1.0 + self.overhead) * (1.0 + self.schedule.save_share) - 1.0


def _tier2_schedule(scale: Scale, fast_interval_s: float, fast_cost_s: float,
                    interval_s: float | None) -> Schedule:
    """Fast saves plus an asynchronous persistent checkpoint at the Young/Daly interval for tier-2 faults."""
    w = scale.workload
    slow_cost = w.background_s(w.storage_s)
    if interval_s is None:
        interval_s = min(daly_interval(max(slow_cost, 1e-9), scale.tier2_mttf_s), MAX_TIER2_INTERVAL_S)
    every = max(1, round(interval_s / fast_interval_s))
    return Schedule(fast_interval_s=fast_interval_s, fast_cost_s=fast_cost_s,
                    slow_every=every, slow_cost_s=slow_cost)


def _check_interval(owner: str, v: float | None) -> None:
    if v is not None:
        _positive(owner, tier2_interval_s=v)


@dataclass(frozen=True, kw_only=True)
class CkptRestart:
    """Checkpoint to persistent storage every `interval_s` (None: Daly optimum); restart the job on failure."""

    interval_s: float | None = None
    save_s: float | None = None
    overhead: float = CKPT_RESTART_OVERHEAD
    restart: JobRestart = field(default_factory=JobRestart)
    name: str = "ckpt-restart"

    def __post_init__(self) -> None:
        check_overhead("ckpt-restart.overhead", self.overhead)
        if self.interval_s is not None:
            _positive("ckpt-restart", interval_s=self.interval_s)
        if self.save_s is not None:
            _non_negative("ckpt-restart", save_s=self.save_s)

    def save_cost(self, w: Workload) -> float:
        """Blocking save: the whole shard to storage unless `save_s` says otherwise."""
        return w.storage_s if self.save_s is None else self.save_s

    def resolve(self, scale: Scale) -> Resolved:
        c = self.save_cost(scale.workload)
        tau = self.interval_s if self.interval_s is not None else daly_interval(max(c, 1e-9), scale.mttf_s)
        phases = self.restart.phases(scale.gpus, scale.workload.storage_s)
        sched = Schedule(fast_interval_s=tau, fast_cost_s=c, slow_every=1, slow_cost_s=c)
        return Resolved(name=self.name, schedule=sched, tier1=phases, tier2=phases, path="tier2",
                        overhead=self.overhead)


@dataclass(frozen=True, kw_only=True)
class InMemory:
    """Gemini-like: copy state to peers' CPU memory every `every_steps`; restart the job, load from memory.

    `peers` machines hold copies of each other's state; losing two of one group during a
    recovery falls back to the persistent checkpoint. The copies cost `overhead` per step
    (Gemini's published figure), not a simulated save.
    """

    every_steps: int = 1
    peers: int = 2
    tier2_interval_s: float | None = None
    overhead: float = GEMINI_OVERHEAD
    restart: JobRestart = field(default_factory=JobRestart)
    name: str = "in-memory"

    def __post_init__(self) -> None:
        check_overhead("in-memory.overhead", self.overhead)
        need(isinstance(self.every_steps, int) and self.every_steps >= 1,
             f"in-memory.every_steps must be an integer >= 1, got {self.every_steps!r}")
        need(isinstance(self.peers, int) and self.peers >= 2,
             f"in-memory.peers must be an integer >= 2 (a copy needs another machine), got {self.peers!r}")
        _check_interval("in-memory", self.tier2_interval_s)

    def resolve(self, scale: Scale) -> Resolved:
        w = scale.workload
        need(self.peers <= scale.nodes, f"in-memory.peers ({self.peers}) exceeds the {scale.nodes} nodes")
        sched = _tier2_schedule(scale, self.every_steps * w.step_s, 0.0, self.tier2_interval_s)
        return Resolved(name=self.name, schedule=sched, tier1=self.restart.phases(scale.gpus, w.network_s),
                        tier2=self.restart.phases(scale.gpus, w.storage_s), path="tier1",
                        guard_nodes=self.peers, overhead=self.overhead)


@dataclass(frozen=True, kw_only=True)
class ReplicaHeal:
    """torchft-like: `replicas` replica groups; a failed group drops out, the rest keep training,
    and the group rejoins after restarting and copying weights from a healthy peer.

    Running with R-1 of R groups for the heal time costs heal/R of productive time; the
    simulator charges it as the `degraded` phase.
    """

    replicas: int = 8
    detect_s: float = 30.0
    quorum_s: float = 1.0
    regroup_per_log2_s: float = 1.0
    tier2_interval_s: float | None = None
    overhead: float = REPLICA_HEAL_OVERHEAD
    restart: JobRestart = field(default_factory=JobRestart)
    name: str = "replica-heal"

    def __post_init__(self) -> None:
        check_overhead("replica-heal.overhead", self.overhead)
        need(isinstance(self.replicas, int) and self.replicas >= 2,
             f"replica-heal.replicas must be an integer >= 2, got {self.replicas!r}")
        _non_negative("replica-heal", detect_s=self.detect_s, quorum_s=self.quorum_s,
                      regroup_per_log2_s=self.regroup_per_log2_s)
        _check_interval("replica-heal", self.tier2_interval_s)

    def heal_s(self, scale: Scale) -> float:
        """A replica group restarts on its own and fetches weights from a peer group."""
        group_gpus = max(1, scale.gpus // self.replicas)
        r = self.restart
        return r.reschedule_s + r.relaunch_per_log2_s * log2_scale(group_gpus) + scale.workload.network_s

    def resolve(self, scale: Scale) -> Resolved:
        need(self.replicas <= scale.nodes,
             f"replica-heal.replicas ({self.replicas}) exceeds the {scale.nodes} nodes; use fewer replicas")
        tier1 = (("detect", self.detect_s), ("decide", self.quorum_s),
                 ("regroup", self.regroup_per_log2_s * log2_scale(self.replicas)),
                 ("degraded", self.heal_s(scale) / self.replicas))
        sched = _tier2_schedule(scale, scale.workload.step_s, 0.0, self.tier2_interval_s)
        return Resolved(name=self.name, schedule=sched, tier1=tier1,
                        tier2=self.restart.phases(scale.gpus, scale.workload.storage_s),
                        path="replica", carry=frozenset({"degraded"}), wait_share=1.0 / self.replicas,
                        overhead=self.overhead)


@dataclass(frozen=True, kw_only=True)
class Unbroken:
    """In place: detect (heartbeat), decide, regroup (a spare takes the rank), rebuild the lost
    shard from parity, redo the steps since the last protected one.

    Parity groups of `parity_group` ranks on distinct nodes; a second failure in a group
    during its recovery, or silent corruption, falls back to the persistent checkpoint (tier 2).
    Rebuild: state / net bandwidth, or the calibrated bench seconds per GB scaled by
    `bench_gbps` / net_gbps (the same fraction of the link as measured on the bench).
    `overhead`: the failure-free cost per step (parity updates included), measured by the
    overhead benchmark (`--calibrate`), else UNCALIBRATED_OVERHEAD.
    """

    detect_s: float = 10.0
    decide_s: float = 1.0
    regroup_per_log2_s: float = 1.0
    regroup_base_s: float = 0.0  # with regroup_per_rank_s: a fit of `unbroken bench regroup` (sim/regroup_fit.py)
    regroup_per_rank_s: float = 0.0
    rebuild_bench_s_per_gb: float | None = None
    bench_gbps: float = 1.0
    protect_every: int = 1
    parity_group: int = 4
    tier2_interval_s: float | None = None
    overhead: float = UNCALIBRATED_OVERHEAD
    restart: JobRestart = field(default_factory=JobRestart)
    name: str = "unbroken"

    def __post_init__(self) -> None:
        check_overhead("unbroken.overhead", self.overhead)
        _non_negative("unbroken", detect_s=self.detect_s, decide_s=self.decide_s,
                      regroup_per_log2_s=self.regroup_per_log2_s, regroup_per_rank_s=self.regroup_per_rank_s)
        _positive("unbroken", bench_gbps=self.bench_gbps)
        if self.rebuild_bench_s_per_gb is not None:
            _non_negative("unbroken", rebuild_bench_s_per_gb=self.rebuild_bench_s_per_gb)
        need(isinstance(self.protect_every, int) and self.protect_every >= 1,
             f"unbroken.protect_every must be an integer >= 1 (steps between parity updates), "
             f"got {self.protect_every!r}")
        need(isinstance(self.parity_group, int) and self.parity_group >= 2,
             f"unbroken.parity_group must be an integer >= 2, got {self.parity_group!r}")
        _check_interval("unbroken", self.tier2_interval_s)

    def regroup_s(self, gpus: int) -> float:
        """base + per_log2 * log2 N + per_rank * N, floored at 0 (a fitted intercept may be negative)."""
        return max(0.0, self.regroup_base_s + self.regroup_per_log2_s * log2_scale(gpus)
                   + self.regroup_per_rank_s * gpus)

    def rebuild_s(self, w: Workload) -> float:
        if self.rebuild_bench_s_per_gb is None:
            return w.network_s
        return w.state_gb * self.rebuild_bench_s_per_gb * self.bench_gbps / w.net_gbps

    def resolve(self, scale: Scale) -> Resolved:
        w = scale.workload
        need(self.parity_group <= scale.nodes,
             f"unbroken.parity_group ({self.parity_group}) needs that many nodes; the cluster has "
             f"{scale.nodes}; use --parity-group {max(2, min(4, scale.nodes))}")
        tier1 = (("detect", self.detect_s), ("decide", self.decide_s),
                 ("regroup", self.regroup_s(scale.gpus)), ("rebuild", self.rebuild_s(w)))
        sched = _tier2_schedule(scale, self.protect_every * w.step_s, 0.0, self.tier2_interval_s)
        return Resolved(name=self.name, schedule=sched, tier1=tier1,
                        tier2=self.restart.phases(scale.gpus, w.storage_s), path="tier1",
                        guard_nodes=self.parity_group, overhead=self.overhead)


Policy = Union[CkptRestart, InMemory, ReplicaHeal, Unbroken]
_CLASSES: dict[str, type] = {"ckpt-restart": CkptRestart, "in-memory": InMemory,
                             "replica-heal": ReplicaHeal, "unbroken": Unbroken}


def make_policy(name: str, **params: Any) -> Policy:
    """Build a policy by name; `params` that the policy does not have are ignored, None means default."""
    if name not in _CLASSES:
        raise SimError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)} or 'all'")
    cls = _CLASSES[name]
    names = {f.name for f in dataclasses.fields(cls)} - {"name"}
    return cls(**{k: v for k, v in params.items() if k in names and v is not None})


def parse_policies(spec: str) -> list[str]:
    """'all' or a comma-separated list of names, in the order given."""
    names = list(POLICY_NAMES) if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    need(bool(names), f"--policy needs a name; choose from {', '.join(POLICY_NAMES)} or 'all'")
    for n in names:
        need(n in _CLASSES, f"unknown policy {n!r}; choose one of {', '.join(POLICY_NAMES)} or 'all'")
    return names


def tier2_mttf_s(mttf_s: float, tier2_share: float) -> float:
    """Mean time between tier-2-only faults (silent corruption); infinite when the mix has none."""
    return math.inf if tier2_share <= 0 else mttf_s / tier2_share


def apply_settings(policies: dict[str, Policy], settings: list[str]) -> dict[str, Policy]:
    """Apply `policy.field=value` (or `policy.restart.field=value`) overrides; value is JSON (5, 0.5, null)."""
    out = dict(policies)
    for item in settings:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        need(sep == "=" and len(parts) in (2, 3) and parts[0] in _CLASSES,
             f"--set {item!r}: expected POLICY.FIELD=VALUE with POLICY one of {', '.join(POLICY_NAMES)}, "
             "e.g. --set unbroken.detect_s=5")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            raise SimError(f"--set {item!r}: the value must be a JSON number, true/false or null") from None
        if parts[0] in out:
            out[parts[0]] = _set_field(out[parts[0]], parts[1:], value, item)
    return out


def _set_field(obj: Any, path: list[str], value: Any, item: str) -> Any:
    names = sorted(f.name for f in dataclasses.fields(obj) if f.name != "name")
    need(path[0] in names, f"--set {item!r}: no field {path[0]!r}; {type(obj).__name__} has {', '.join(names)}")
    sub = getattr(obj, path[0])
    if len(path) == 1:
        if dataclasses.is_dataclass(sub):
            raise SimError(f"--set {item!r}: set the fields of {path[0]!r}, e.g. "
                           f"{item.split('.')[0]}.{path[0]}.detect_s=30")
        return dataclasses.replace(obj, **{path[0]: value})
    need(dataclasses.is_dataclass(sub), f"--set {item!r}: {path[0]!r} has no fields")
    return dataclasses.replace(obj, **{path[0]: _set_field(sub, path[1:], value, item)})
