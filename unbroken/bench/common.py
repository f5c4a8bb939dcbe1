"""What every benchmark shares: running a job under unbroken, reading its step times, saving results.

Results go to `bench/results/NAME.json` (atomically) with a `machine` block, because on a
shared 2-core box the absolute numbers only mean something next to the ratios, and with
the `commit` (git HEAD, null outside a checkout) and `dirty` flag of the code that ran.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
import uuid
from pathlib import Path
from typing import Iterable

from rich.console import Console

from unbroken.config import RunConfig
from unbroken.events import Event, read_events
from unbroken.fsutil import atomic_write_json
from unbroken.plan.ranks import free_port  # noqa: F401 - the benches' one free port, re-exported
from unbroken.provenance import git_commit  # noqa: F401  (re-exported: benchmarks record it)
from unbroken.runtime.procs import kill_pids

RESULTS_DIR = Path("bench/results")
SKIP_STEPS = 2  # the first steps pay for start-up (lazy allocation, the shadow importing torch)


def machine() -> dict:
    """Where the numbers came from; load average because other work shares the cores, the CPU model and
    torch's vector capability because hosts of one kind differ (the same code ran 15-40 % slower on
    one without AVX-512: docs/benchmarks.md, stop 48)."""
    import torch

    return {"cpus": os.cpu_count(), "cpu_model": _cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(terse=True), "loadavg": [round(x, 2) for x in os.getloadavg()],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _cpu_model() -> str:
    """/proc/cpuinfo's "model name" (Linux), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_result(name: str, data: dict, out_dir: Path = RESULTS_DIR) -> Path:
    path = Path(out_dir) / f"{name}.json"
    atomic_write_json(path, {**data, "benchmark": name, "machine": machine(), **git_commit()})
    return path


def median(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


def step_events(events: list[Event], *, rank: int = 0) -> list[Event]:
    """Rank `rank`'s `step` events in time order (one per completed step execution)."""
    return [e for e in events if e.kind == "step" and e.rank == rank]


def steady_step_times(events: list[Event], *, skip: int = SKIP_STEPS, rank: int = 0) -> list[float]:
    """step_s of every step after the first `skip` (start-up noise), from one rank."""
    return [float(e.fields["step_s"]) for e in step_events(events, rank=rank) if e.fields.get("step", 0) > skip]


def run_job(cfg: RunConfig, run_dir: Path, *, faults: tuple = (), console: Console | None = None) -> dict:
    """Run the built-in tiny-GPT job under unbroken and return its summary (events stay in run_dir)."""
    from unbroken.runtime.run import launch
    from unbroken.runtime.supervisor import LaunchOptions

    opts = LaunchOptions(run_dir=Path(run_dir).resolve(), faults=tuple(faults), tee="none")  # logs stay in run_dir
    return launch(cfg, opts, console=console or Console(stderr=True), progress=False)


def job_events(run_dir: Path) -> list[Event]:
    return read_events(Path(run_dir))




def fmt(v: object, digits: int = 3) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def goal(ok: bool | None) -> str:
    return "[dim]n/a[/]" if ok is None else ("[green]met[/]" if ok else "[red]missed[/]")


LAUNCH_TAG = "UNBROKEN_LAUNCH_TAG"  # marks every process one launcher call started, however deep


def tagged_env(env: dict | None = None) -> tuple[dict, str]:
    """`env` (default: ours) plus a fresh launch tag; the tag, for `reap_tagged`."""
    tag = uuid.uuid4().hex
    return {**(os.environ if env is None else env), LAUNCH_TAG: tag}, tag


def pids_with_env(entry: str) -> list[int]:
    """Pids (ours excluded) whose environment holds `entry` ("NAME=value")."""
    needle, pids = entry.encode(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes():
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def reap_tagged(tag: str) -> list[int]:
    """SIGKILL every process whose environment carries `tag`: a launcher (torchrun) may exit while a
    worker it started in a session of its own still waits on a dead peer. Returns their pids."""
    return kill_pids(pids_with_env(f"{LAUNCH_TAG}={tag}"))
