"""The overlap plan: whether gradient buckets are all-reduced during or after backward, their
size, and how a rank's cores are split between its training thread and its communication and
protection threads (Linux per-thread affinity). Plans are read from and written to JSON files.

Compute stays on `RunConfig.threads` intra-op threads whatever the partition: kernels are
bitwise reproducible only at a fixed thread count (docs/design.md), so a partition moves
threads between cores, never changes how many compute threads there are.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "unbroken-overlap/1"
from unbroken.config import COLLECTIVES, OVERLAP_MODES as MODES, check_overlap_mode as check_mode  # noqa: F401
PARTITIONS = ("shared", "pinned", "split", "cores")


class PlanError(ValueError):
    """A plan (or plan file) is wrong; the message names the field and the fix."""


# Taken at import, before any partition pins a thread: sched_getaffinity answers for one thread.
_START_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask when it started), sorted."""
    return list(_START_CORES)


def _tids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return {threading.get_native_id()}


@dataclass(frozen=True, kw_only=True)
class Partition:
    """How one rank's cores are split. shared: no pinning (the OS schedules every thread);
    pinned: the training thread on one core (local rank mod cores), the others anywhere;
    split: the training thread on that core, communication threads on the remaining ones;
    cores: explicit core lists for the training thread and the communication threads."""

    name: str = "shared"
    compute_cores: tuple[int, ...] = ()
    comm_cores: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.name not in PARTITIONS:
            raise PlanError(f"overlap partition must be one of {', '.join(PARTITIONS)}, got {self.name!r}")
        if self.name == "cores":
            if not self.compute_cores or not self.comm_cores:
                raise PlanError("overlap partition 'cores' needs non-empty compute_cores and comm_cores lists, "
                                "e.g. {\"compute_cores\": [0], \"comm_cores\": [1]}")
            have = available_cores()
            lacking = sorted((set(self.compute_cores) | set(self.comm_cores)) - set(have))
            if lacking:
                raise PlanError(f"overlap partition names core(s) {lacking} this machine does not give the job "
                                f"(it may use {have}); list only those cores")
        elif self.compute_cores or self.comm_cores:
            raise PlanError(f"overlap partition {self.name!r} takes no core lists (only 'cores' does)")
        if self.name != "shared" and not hasattr(os, "sched_setaffinity"):
            raise PlanError(f"overlap partition {self.name!r} needs per-thread affinity (Linux); use 'shared'")

    def to_json(self) -> str | dict:
        if self.name != "cores":
            return self.name
        return {"compute_cores": list(self.compute_cores), "comm_cores": list(self.comm_cores)}

    @staticmethod
    def from_json(v: object) -> "Partition":
        if isinstance(v, str):
            return Partition(name=v)
        if isinstance(v, dict) and set(v) <= {"compute_cores", "comm_cores"}:
            ints = lambda k: tuple(int(c) for c in v.get(k, ()))  # noqa: E731
            return Partition(name="cores", compute_cores=ints("compute_cores"), comm_cores=ints("comm_cores"))
        raise PlanError(f"overlap partition must be one of {', '.join(PARTITIONS[:-1])} or "
                        f"{{\"compute_cores\": [...], \"comm_cores\": [...]}}, got {v!r}")

    def cores(self, local_rank: int) -> tuple[set[int] | None, set[int] | None]:
        """(training thread's cores, the other threads' cores); None = leave as the OS has it."""
        have = available_cores()
        if self.name == "shared":
            return None, None
        if self.name == "cores":
            return set(self.compute_cores), set(self.comm_cores)
        mine = have[local_rank % len(have)]
        if self.name == "pinned":
            return {mine}, set(have)
        return {mine}, (set(have) - {mine}) or {mine}


@dataclass(frozen=True, kw_only=True)
class OverlapPlan:
    """during_backward: buckets all-reduced from the gradient hooks (else after backward);
    bucket_kb: bucket size; first_bucket_kb: the first bucket's (the last layers' gradients, ready
    first: small, so communication starts early in backward, as torch DDP's 1 MiB first bucket;
    at most bucket_kb); eager_update: each bucket's update applied as its all-reduce lands
    (parallel/eager.py; opt-in: its undo copies cost more than it hides where the cores are busy,
    docs/design.md); partition: the core split; collectives: the gradient all-reduce (None: the
    job's --collectives; the tuner may pick the rank-order chain on a multi-node job, shared memory on one node); source: where
    the plan came from."""

    during_backward: bool = True
    bucket_kb: int = 25600
    first_bucket_kb: int = 1024
    eager_update: bool = False
    partition: Partition = field(default_factory=Partition)
    collectives: str | None = None
    source: str = "config"

    def __post_init__(self) -> None:
        for name in ("bucket_kb", "first_bucket_kb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"overlap {name} must be an integer >= 1 (KiB), got {v!r}; e.g. \"{name}\": 1024")
        if self.collectives is not None and self.collectives not in COLLECTIVES:
            raise PlanError(f"overlap collectives must be one of {', '.join(COLLECTIVES)} (or absent: the job's "
                            f"--collectives), got {self.collectives!r}")

    @property
    def bucket_elems(self) -> int:
        return max(16, self.bucket_kb * 1024 // 4)

    @property
    def first_bucket_elems(self) -> int:
        return min(self.bucket_elems, max(16, self.first_bucket_kb * 1024 // 4))

    @property
    def bucket_sizes(self) -> tuple[int, int]:
        """(bucket_elems, first_bucket_elems): GradBuckets' two sizes."""
        return self.bucket_elems, self.first_bucket_elems

    def to_dict(self) -> dict:
        return {"during_backward": self.during_backward, "bucket_kb": self.bucket_kb,
                "first_bucket_kb": self.first_bucket_kb, "eager_update": self.eager_update,
                "partition": self.partition.to_json(), "collectives": self.collectives, "source": self.source}

    @staticmethod
    def from_dict(d: dict, source: str) -> "OverlapPlan":
        return OverlapPlan(during_backward=bool(d.get("during_backward", True)), bucket_kb=d.get("bucket_kb"),
                           first_bucket_kb=d.get("first_bucket_kb", 1024),
                           eager_update=bool(d.get("eager_update", False)),
                           partition=Partition.from_json(d.get("partition", "shared")),
                           collectives=d.get("collectives"), source=source)


def read_plan_file(path: str | Path) -> dict | None:
    """The plan file's JSON (None if there is none yet); PlanError when it is unreadable or its
    plan is invalid (a bucket size <= 0, cores the machine lacks, ...)."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"overlap plan file {p} is not readable JSON ({e}); fix or delete it") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("plan"), dict):
        raise PlanError(f"overlap plan file {p} is not an unbroken overlap plan (format {FORMAT!r} with a 'plan' "
                        "object); fix or delete it")
    try:
        OverlapPlan.from_dict(d["plan"], source="file")
    except (PlanError, TypeError, ValueError) as e:
        raise PlanError(f"overlap plan file {p}: {e}") from None
    return d


def plan_file_text(plan: OverlapPlan, key: dict | None, measured: dict | None = None) -> dict:
    out = {"format": FORMAT, "plan": {k: v for k, v in plan.to_dict().items() if k != "source"}}
    if key is not None:
        out["key"] = key
    if measured is not None:
        out["measured"] = measured
    return out


# Communication and protection threads: gloo's (named by the OS), our collective waiter and tier-2 writer.
_COMM_OS_NAMES = ("gloo", "pt_gloo")
_COMM_PY_NAMES = ("unbroken-wait", "unbroken-tier2")


def _is_comm(tid: int, py_names: dict[int, str]) -> bool:
    if py_names.get(tid, "").startswith(_COMM_PY_NAMES):
        return True
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip().startswith(_COMM_OS_NAMES)
    except OSError:
        return False


class ThreadPinner:
    """Applies a partition to this process's threads: the training thread (the one calling
    `refresh`) to the compute cores, gloo's threads, the collective waiter and the tier-2
    writer to the communication cores, and every other thread (heartbeat, store clients,
    watchers: control traffic that must never starve) to all the process's cores (a thread
    started by the training thread inherits its cores). Threads are started later (a new
    generation's gloo group, a checkpoint), so `refresh` places the ones it has not seen yet."""

    def __init__(self, partition: Partition, local_rank: int) -> None:
        self.compute, self.comm = partition.cores(local_rank)
        self._seen: set[int] = set()

    @property
    def active(self) -> bool:
        return self.compute is not None

    def refresh(self) -> int:
        """Pin threads not pinned yet; returns how many were pinned now."""
        if self.compute is None:
            return 0
        me, tids = threading.get_native_id(), _tids()
        py_names = {t.native_id: t.name for t in threading.enumerate()}
        n = 0
        for tid in sorted(tids - self._seen):
            cores = self.compute if tid == me else self.comm if _is_comm(tid, py_names) else set(_START_CORES)
            try:
                os.sched_setaffinity(tid, cores)
                n += 1
            except OSError:  # the thread ended meanwhile
                pass
        self._seen = tids
        return n

    def release(self) -> None:
        """Every thread back on all the process's cores (before another partition is tried)."""
        if self.compute is None:
            return
        for tid in _tids():
            try:
                os.sched_setaffinity(tid, set(_START_CORES))
            except OSError:
                pass
        self._seen = set()
