"""Observations the detectors consume: worker heartbeats, host signals, GPU health probes.

Everything here reads or carries data; nothing decides. Readers never raise on a
missing source: they return `None` fields (host) or `None` with a reason (GPU probe).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

_GB = 1024 ** 3


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """What a worker publishes every `heartbeat_s` (e.g. as JSON under a TCPStore key).

    `step` is the step being executed and `phase` its current phase; `step_s` and
    `wait_s` describe the previous, completed step (`step - 1`): its wall time and
    the part of it spent waiting in collectives. Both are None before step 0 ends.
    """

    proc: str
    rank: int | None
    node: int
    step: int
    phase: str
    time: float
    step_s: float | None = None
    wait_s: float | None = None

    def __post_init__(self) -> None:
        if not self.proc:
            raise ValueError("Heartbeat.proc must name the process (e.g. 'w2'), got an empty string")
        if self.step < 0:
            raise ValueError(f"Heartbeat.step must be >= 0, got {self.step!r}")
        for name in ("step_s", "wait_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"Heartbeat.{name} must be a finite number >= 0 or None, got {v!r}")

    @property
    def busy_s(self) -> float | None:
        """Time the previous step spent computing (step time minus collective wait)."""
        if self.step_s is None:
            return None
        return max(0.0, self.step_s - (self.wait_s or 0.0))

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @staticmethod
    def decode(data: bytes | str) -> "Heartbeat":
        """Parse `encode()` output; a malformed payload raises ValueError."""
        try:
            d = json.loads(data)
            return Heartbeat(**d)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a heartbeat payload ({e}): {data[:80]!r}") from None


@dataclass(frozen=True, kw_only=True)
class HostSignals:
    """Host health without a GPU: 1-minute load, memory, free disk of the checkpoint directory."""

    load1: float | None
    mem_available_gb: float | None
    mem_total_gb: float | None
    disk_free_gb: float | None

    def event_fields(self) -> dict[str, Any]:
        """Fields of a `host` event."""
        return {"load": self.load1, "mem_available_gb": self.mem_available_gb,
                "disk_free_gb": self.disk_free_gb}


def parse_meminfo(text: str) -> tuple[float | None, float | None]:
    """(MemAvailable, MemTotal) in GB from /proc/meminfo text; None where absent."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0]) * 1024 / _GB  # meminfo reports kB
    return values.get("MemAvailable"), values.get("MemTotal")


def read_host_signals(checkpoint_dir: str | os.PathLike) -> HostSignals:
    """Read load, memory and the free space where checkpoints go; never raises."""
    try:
        load1: float | None = os.getloadavg()[0]
    except OSError:
        load1 = None
    try:
        avail, total = parse_meminfo(Path("/proc/meminfo").read_text())
    except OSError:
        avail, total = None, None
    return HostSignals(load1=load1, mem_available_gb=avail, mem_total_gb=total,
                       disk_free_gb=_disk_free_gb(Path(checkpoint_dir)))


def _disk_free_gb(path: Path) -> float | None:
    # The checkpoint directory may not exist yet: measure the filesystem it will live on.
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free / _GB
    except OSError:
        return None


def read_proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (R, S, D, T, Z, ...), or None if unknown.

    'T' (stopped) turns a silent heartbeat into certain evidence of a hang.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; the state follows the last ')'.
    tail = stat[stat.rfind(")") + 1:].split()
    return tail[0] if tail else None


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """One GPU health probe: ok, or the problems found, plus per-GPU readings."""

    probe: str
    ok: bool
    problems: tuple[str, ...] = ()
    gpus: tuple[dict[str, Any], ...] = ()


@runtime_checkable
class HealthProbe(Protocol):
    """A pluggable hardware health check. `probe()` returns None when it cannot run
    here (the reason is then in `skipped_reason`) and never raises."""

    name: str
    skipped_reason: str | None

    def probe(self) -> ProbeResult | None: ...


# Fields every nvidia-smi since the R384 drivers answers; an unknown field fails the whole query.
NVIDIA_SMI_FIELDS = ("index", "temperature.gpu", "memory.used", "memory.total",
                     "ecc.errors.uncorrected.volatile.total")


class NvidiaSmiProbe:
    """GPU health from `nvidia-smi --query-gpu`: fails on uncorrected ECC errors, a GPU
    over `max_temp_c`, or nvidia-smi itself failing or hanging (a wedged driver)."""

    name = "nvidia-smi"

    def __init__(self, *, executable: str = "nvidia-smi", timeout_s: float = 10.0,
                 max_temp_c: float = 90.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"NvidiaSmiProbe timeout_s must be > 0, got {timeout_s!r}; e.g. 10.0")
        if max_temp_c <= 0:
            raise ValueError(f"NvidiaSmiProbe max_temp_c must be > 0 (Celsius), got {max_temp_c!r}; e.g. 90")
        self.executable, self.timeout_s, self.max_temp_c = executable, timeout_s, max_temp_c
        self.skipped_reason: str | None = None

    def probe(self) -> ProbeResult | None:
        exe = shutil.which(self.executable)
        if exe is None:
            self.skipped_reason = f"{self.executable} not found on PATH; GPU health probe skipped"
            return None
        self.skipped_reason = None
        cmd = [exe, f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader,nounits"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            return self._failed(f"nvidia-smi did not answer within {self.timeout_s:g} s (wedged driver?)")
        except OSError as e:
            return self._failed(f"cannot run {exe}: {e.strerror or e}")
        if out.returncode != 0:
            first = (out.stderr or out.stdout).strip().splitlines()
            return self._failed(f"nvidia-smi exited {out.returncode}: {first[0] if first else 'no output'}")
        return parse_nvidia_smi(out.stdout, max_temp_c=self.max_temp_c, probe=self.name)

    def _failed(self, problem: str) -> ProbeResult:
        return ProbeResult(probe=self.name, ok=False, problems=(problem,))


def parse_nvidia_smi(text: str, *, max_temp_c: float, probe: str = "nvidia-smi") -> ProbeResult:
    """Judge `--query-gpu=NVIDIA_SMI_FIELDS --format=csv,noheader,nounits` output."""
    gpus: list[dict[str, Any]] = []
    problems: list[str] = []
    for line in filter(None, (ln.strip() for ln in text.splitlines())):
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(NVIDIA_SMI_FIELDS):
            problems.append(f"unexpected nvidia-smi line {line!r}")
            continue
        gpu: dict[str, Any] = {k: _cell(v) for k, v in zip(NVIDIA_SMI_FIELDS, cells)}
        gpu["index"] = int(cells[0]) if cells[0].isdigit() else cells[0]
        gpus.append(gpu)
        idx, temp, ecc = gpu["index"], gpu["temperature.gpu"], gpu["ecc.errors.uncorrected.volatile.total"]
        if ecc is not None and ecc > 0:
            problems.append(f"GPU {idx}: {ecc:g} uncorrected ECC errors")
        if temp is not None and temp > max_temp_c:
            problems.append(f"GPU {idx}: {temp:g} C is above {max_temp_c:g} C")
    if not gpus and not problems:
        problems.append("nvidia-smi listed no GPUs")
    return ProbeResult(probe=probe, ok=not problems, problems=tuple(problems), gpus=tuple(gpus))


def _cell(v: str) -> float | None:
    # Unsupported readings print as "[N/A]" / "[Not Supported]" (e.g. ECC on consumer GPUs, MIG).
    try:
        return float(v)
    except ValueError:
        return None
