"""Failure classes and their rates: the swappable data file (default: the Llama 3 405B mix).

A mix is counts observed on `gpus` GPUs over `days`; each class's per-GPU rate is
count / (gpus x hours), and a cluster of N GPUs fails N times as often (linear scaling).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from unbroken.sim.errors import SimError, need

KINDS = ("operable", "replace")
FAULTS = ("crash", "hang", "exception", "numerics", "straggler", "stall")
DEFAULT_MIX_FILE = "llama3_mix.json"


@dataclass(frozen=True, kw_only=True)
class FailureClass:
    """One component class: how often it failed and whether the node survives it.

    kind "operable": the fault clears by restarting the process on the same node
    (in-place recovery possible); "replace": the node must go. `corrupts_state`
    marks faults (silent data corruption) that poison in-memory redundancy too, so
    every policy must roll back to a persistent checkpoint.
    """

    name: str
    count: float
    kind: str
    label: str = ""
    fault: str = "crash"
    corrupts_state: bool = False

    def __post_init__(self) -> None:
        need(isinstance(self.name, str) and self.name != "",
             f"a failure class needs a non-empty 'name', got {self.name!r}")
        need(isinstance(self.count, (int, float)) and not isinstance(self.count, bool)
             and math.isfinite(self.count) and self.count > 0,
             f"failure class {self.name!r}: count must be a number > 0, got {self.count!r}; "
             "drop the class instead of giving it a zero rate")
        need(self.kind in KINDS,
             f"failure class {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        need(self.fault in FAULTS,
             f"failure class {self.name!r}: fault must be one of {', '.join(FAULTS)}, got {self.fault!r}")
        need(isinstance(self.corrupts_state, bool),
             f"failure class {self.name!r}: corrupts_state must be true or false, got {self.corrupts_state!r}")


@dataclass(frozen=True, kw_only=True)
class FailureMix:
    """Observed failure counts on a reference cluster; rates scale linearly with GPU count."""

    gpus: int
    days: float
    classes: tuple[FailureClass, ...]
    source: str = ""

    def __post_init__(self) -> None:
        need(isinstance(self.gpus, int) and not isinstance(self.gpus, bool) and self.gpus >= 1,
             f"rates 'gpus' (the observed cluster size) must be an integer >= 1, got {self.gpus!r}")
        need(isinstance(self.days, (int, float)) and not isinstance(self.days, bool)
             and math.isfinite(self.days) and self.days > 0,
             f"rates 'days' (the observation window) must be a number > 0, got {self.days!r}")
        need(len(self.classes) >= 1, "rates need at least one failure class in 'classes'")
        names = [c.name for c in self.classes]
        dup = sorted({n for n in names if names.count(n) > 1})
        need(not dup, f"failure class names must be unique; {dup[0] if dup else ''!r} appears twice")

    @property
    def total(self) -> float:
        return float(sum(c.count for c in self.classes))

    def rate_per_gpu_hour(self) -> float:
        """Failures per GPU-hour, all classes together."""
        return self.total / (self.gpus * self.days * 24.0)

    def mttf_hours(self, gpus: int) -> float:
        """Mean time to (job) failure of a synchronous job on `gpus` GPUs."""
        return 1.0 / (self.rate_per_gpu_hour() * gpus)

    def probabilities(self) -> list[float]:
        return [c.count / self.total for c in self.classes]


def mix_from_dict(d: Any, origin: str = "rates") -> FailureMix:
    """Build a mix from the JSON structure documented in docs/simulator.md."""
    need(isinstance(d, dict), f"{origin}: expected a JSON object with gpus, days, classes; got {type(d).__name__}")
    missing = [k for k in ("gpus", "days", "classes") if k not in d]
    need(not missing, f"{origin}: missing key {missing[0] if missing else ''!r}; "
         "a rates file needs 'gpus', 'days' and a list 'classes'")
    raw = d["classes"]
    need(isinstance(raw, list), f"{origin}: 'classes' must be a list of objects, got {type(raw).__name__}")
    allowed = {"name", "count", "kind", "label", "fault", "corrupts_state"}
    classes = []
    for i, c in enumerate(raw):
        need(isinstance(c, dict), f"{origin}: classes[{i}] must be an object, got {c!r}")
        unknown = sorted(set(c) - allowed)
        need(not unknown, f"{origin}: classes[{i}] has unknown key {unknown[0] if unknown else ''!r}; "
             f"allowed: {', '.join(sorted(allowed))}")
        need("name" in c and "count" in c and "kind" in c,
             f"{origin}: classes[{i}] needs 'name', 'count' and 'kind' (operable|replace)")
        classes.append(FailureClass(**c))
    return FailureMix(gpus=d["gpus"], days=d["days"], classes=tuple(classes), source=str(d.get("source", "")))


def load_mix(path: str | Path) -> FailureMix:
    """Read a rates JSON file; a missing, unreadable or malformed file raises SimError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise SimError(f"cannot read rates file {str(p)!r}: {e.strerror or e}; "
                       "pass --rates with a readable JSON file") from None
    except UnicodeDecodeError:
        raise SimError(f"rates file {str(p)!r} is not UTF-8 text; it must be JSON") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise SimError(f"rates file {str(p)!r} is not valid JSON (line {e.lineno}: {e.msg})") from None
    return mix_from_dict(d, origin=str(p))


def default_mix() -> FailureMix:
    """The Llama 3 405B mix shipped with the package."""
    text = resources.files("unbroken.sim").joinpath(DEFAULT_MIX_FILE).read_text(encoding="utf-8")
    return mix_from_dict(json.loads(text), origin=DEFAULT_MIX_FILE)
