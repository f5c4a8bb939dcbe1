"""Dedicated CPU slices for the RL pool's workers: each worker process in a cpu cgroup of its own
whose quota is its share of the machine's cores (cores / processes), so that a worker's idle
time is lost, as an accelerator's is. Without slices, the kernel hands an idle worker's CPU to
the busy ones: on a CPU box every static split then balances itself, and moving processes
between pools measures nothing but noise.

Needs root and a writable cpu controller: cgroup v1 (`cpu.cfs_quota_us`) or v2 (`cpu.max`).
`CpuSlices.open` returns None with the reason when there is none; the caller runs without.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

PERIOD_US = 10_000  # short: a worker at half a core runs 5 ms of every 10, not 50 ms then 50 ms idle
V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


def quota_us(share: float, period_us: int = PERIOD_US) -> int:
    """The CFS quota of `share` cores per period (the kernel's floor is 1000 us)."""
    if not share > 0:
        raise ValueError(f"a CPU slice must be > 0 cores, got {share}")
    return max(1000, round(share * period_us))


def _writable_root() -> tuple[Path, str] | str:
    """(the cgroup directory to create slices under, "v1" | "v2"), or why there is none."""
    if os.geteuid() != 0:
        return "CPU slices need root (cgroups are root's)"
    if (V1_ROOT / "cpu.cfs_quota_us").exists() and os.access(V1_ROOT, os.W_OK):
        return V1_ROOT, "v1"
    control = V2_ROOT / "cgroup.subtree_control"
    if control.exists() and "cpu" in control.read_text().split() and os.access(V2_ROOT, os.W_OK):
        return V2_ROOT, "v2"
    return "no writable cpu cgroup controller (neither v1 cpu.cfs_quota_us nor v2 cpu.max)"


@dataclass
class CpuSlices:
    """One cgroup per added process under base/unbroken-rl-<id>/, each with `share` cores."""
    base: Path
    version: str
    share: float
    dirs: list[Path] = field(default_factory=list)

    @classmethod
    def open(cls, share: float) -> tuple["CpuSlices | None", str | None]:
        """(slices, None) or (None, why not)."""
        root = _writable_root()
        if isinstance(root, str):
            return None, root
        base = root[0] / f"unbroken-rl-{uuid.uuid4().hex[:8]}"
        try:
            base.mkdir()
        except OSError as e:
            return None, f"cannot create a cpu cgroup under {root[0]}: {e}"
        return cls(base, root[1], share), None

    def add(self, name: str, pid: int) -> None:
        """Put process `pid` (all its threads) in a slice of its own."""
        d = self.base / name
        d.mkdir(exist_ok=True)
        if self.version == "v1":
            (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (d / "cpu.cfs_quota_us").write_text(str(quota_us(self.share)))
        else:
            (d / "cpu.max").write_text(f"{quota_us(self.share)} {PERIOD_US}")
        (d / "cgroup.procs").write_text(str(pid))
        self.dirs.append(d)

    def describe(self) -> dict:
        return {"cgroup": self.version, "cores_per_process": self.share, "period_us": PERIOD_US,
                "quota_us": quota_us(self.share)}

    def close(self) -> None:
        """Remove the slices (their processes have exited: a cgroup with tasks cannot go)."""
        for d in [*self.dirs, self.base]:
            try:
                d.rmdir()
            except OSError:
                pass  # a process still in it (then the kernel keeps the group until it exits)
        self.dirs.clear()


def fair_share(processes: int) -> float:
    """Each of `processes` workers' share of the cores this process may run on."""
    return len(os.sched_getaffinity(0)) / processes
