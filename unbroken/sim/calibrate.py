"""Costs measured by the benchmarks (bench/results/*.json), scaled up to cluster size.

`--calibrate PATH` (repeatable) takes the recovery benchmark's JSON, the overhead
benchmark's JSON (sim/overhead.py), or a directory holding recovery.json and/or
overhead.json; a file is recognised by its keys.

Recovery scaling model: detect and decide are taken as measured; regroup and job relaunch
grow like log2(ranks); rebuild keeps the measured seconds per GB and the bench's share of
its link. Missing optional keys fall back to documented defaults, each one named in `notes`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.sim.costs import log2_scale
from unbroken.sim.errors import SimError, need
from unbroken.sim.overhead import OVERHEAD_FILE, OverheadCalibration, overhead_from_dict
from unbroken.sim.policies import Policy, Unbroken
from unbroken.sim.regroup_fit import MULTINODE_FILE, RegroupFit, regroup_fit_from_dict

DEFAULT_RANKS = 4
RECOVERY_FILE = "recovery.json"
PHASES = ("detect", "decide", "regroup", "rebuild", "redo")


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What the benchmark measured (seconds at `ranks` ranks); None where the file did not say."""

    source: str
    ranks: int
    baseline_recovery_s: float
    unbroken_recovery_s: float
    breakdown: dict[str, float]
    state_gb: float | None = None
    steps_redone: float | None = None
    ratio: float | None = None
    notes: tuple[str, ...] = ()


def _mean(v: Any, where: str) -> float:
    """A number, or the mean of a non-empty list of numbers, all >= 0."""
    vals = v if isinstance(v, list) else [v]
    ok = bool(vals) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                            and math.isfinite(x) and x >= 0 for x in vals)
    need(ok, f"{where} must be a number >= 0 or a non-empty list of them, got {v!r}")
    return float(sum(vals)) / len(vals)


def _section(d: dict[str, Any], key: str, origin: str) -> dict[str, Any]:
    sec = d.get(key)
    need(isinstance(sec, dict), f"{origin}: needs an object {key!r} with 'recovery_s' (seconds per kill)")
    need("recovery_s" in sec, f"{origin}: missing '{key}.recovery_s' (a list of seconds, one per kill)")
    return sec


def _breakdown(ub: dict[str, Any], origin: str, notes: list[str]) -> dict[str, float]:
    raw = ub.get("breakdown")
    if raw is None:
        notes.append("no unbroken.breakdown: scaled the default phase model to the measured total")
        return {}
    need(isinstance(raw, dict), f"{origin}: 'unbroken.breakdown' must map phase -> seconds, got {raw!r}")
    unknown = sorted(set(raw) - set(PHASES))
    if unknown:
        notes.append(f"ignored unknown breakdown phases: {', '.join(map(str, unknown))}")
    out = {k: _mean(raw[k], f"{origin}: unbroken.breakdown.{k}") for k in PHASES if k in raw}
    missing = [k for k in PHASES[:4] if k not in out]
    if missing:
        notes.append(f"breakdown lacks {', '.join(missing)}: default model used for those phases")
    return out


def calibration_from_dict(d: Any, origin: str) -> Calibration:
    need(isinstance(d, dict), f"{origin}: expected a JSON object with 'baseline' and 'unbroken', "
         f"got {type(d).__name__}")
    base, ub = _section(d, "baseline", origin), _section(d, "unbroken", origin)
    notes: list[str] = []
    ranks = d.get("world_size", d.get("ranks", ub.get("world_size")))
    if ranks is None:
        notes.append(f"no world_size: assumed the benchmark ran {DEFAULT_RANKS} ranks")
        ranks = DEFAULT_RANKS
    need(isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 2,
         f"{origin}: world_size must be an integer >= 2, got {ranks!r}")
    state = ub.get("state_bytes_per_rank")
    if state is None:
        notes.append("no unbroken.state_bytes_per_rank: rebuild uses the default state / bandwidth model")
    else:
        need(isinstance(state, (int, float)) and not isinstance(state, bool) and state > 0,
             f"{origin}: unbroken.state_bytes_per_rank must be a number > 0, got {state!r}")
    steps = ub.get("steps_redone")
    if steps is None:
        notes.append("no unbroken.steps_redone: parity protects every step")
    ratio = d.get("ratio")
    if ratio is not None:
        need(isinstance(ratio, (int, float)) and not isinstance(ratio, bool),
             f"{origin}: 'ratio' must be a number, got {ratio!r}")
    return Calibration(
        source=origin, ranks=ranks,
        baseline_recovery_s=_mean(base["recovery_s"], f"{origin}: baseline.recovery_s"),
        unbroken_recovery_s=_mean(ub["recovery_s"], f"{origin}: unbroken.recovery_s"),
        breakdown=_breakdown(ub, origin, notes),
        state_gb=None if state is None else float(state) / 1e9,
        steps_redone=None if steps is None else _mean(steps, f"{origin}: unbroken.steps_redone"),
        ratio=None if ratio is None else float(ratio), notes=tuple(notes))


def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise SimError(f"cannot read calibration file {str(p)!r}: {e.strerror or e}; "
                       "run the benchmark first or pass --calibrate with its JSON") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SimError(f"calibration file {str(p)!r} is not valid JSON ({e}); rerun the benchmark "
                       "that wrote it") from None


def load_calibration(path: str | Path) -> Calibration:
    """Read the recovery benchmark's JSON; unreadable or malformed files raise SimError."""
    p = Path(path)
    return calibration_from_dict(_read_json(p), str(p))


def load_overhead(path: str | Path) -> OverheadCalibration:
    """Read the overhead benchmark's JSON; unreadable or malformed files raise SimError."""
    p = Path(path)
    return overhead_from_dict(_read_json(p), str(p))


@dataclass(frozen=True, kw_only=True)
class Calibrations:
    """What `--calibrate` found: the recovery and overhead measurements (None if not given), and
    `overhead_missing`: why unbroken's overhead stays uncalibrated (None when it is calibrated)."""

    recovery: Calibration | None = None
    overhead: OverheadCalibration | None = None
    overhead_missing: str | None = None
    regroup: RegroupFit | None = None  # `unbroken bench regroup`'s fit (multinode.json)

    @property
    def notes(self) -> tuple[str, ...]:
        return (self.recovery.notes if self.recovery else ()) + (self.overhead.notes if self.overhead else ())


def _kind(d: Any, origin: str) -> str:
    """'recovery', 'overhead' or 'regroup', by the keys of a benchmark's JSON."""
    if not isinstance(d, dict) or "baseline" in d or "unbroken" in d:
        return "recovery"  # calibration_from_dict names what is wrong with a non-object
    if "regroup_fit" in d:
        return "regroup"
    need("ratio" in d, f"{origin}: neither the recovery benchmark's JSON ('baseline', 'unbroken'), the "
         "overhead benchmark's ('ratio' per strategy and world size) nor multinode.json with 'regroup_fit'; "
         "pass one of those files")
    return "overhead"


def load_calibrations(paths: list[str | Path]) -> Calibrations:
    """Every --calibrate PATH: a benchmark JSON (kind by its keys) or a directory with recovery.json
    and/or overhead.json. At most one file of each kind."""
    found: dict[str, Any] = {}
    missing = "no overhead file among the --calibrate paths"
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            files = [(k, p / name, _read_json(p / name))
                     for k, name in (("recovery", RECOVERY_FILE), ("overhead", OVERHEAD_FILE))
                     if (p / name).is_file()]
            need(bool(files), f"--calibrate {str(p)!r}: the directory holds neither {RECOVERY_FILE} nor "
                 f"{OVERHEAD_FILE}; run `unbroken bench recovery` / `unbroken bench overhead` first")
            if not (p / OVERHEAD_FILE).is_file():
                missing = f"no {OVERHEAD_FILE} in {p}"
        else:
            d = _read_json(p)
            files = [(_kind(d, str(p)), p, d)]
        for kind, f, d in files:
            need(kind not in found, f"--calibrate: two {kind} files ({found[kind][0] if kind in found else ''}, "
                 f"{f}); pass one")
            found[kind] = (f, d)
    rec, ov, rg = found.get("recovery"), found.get("overhead"), found.get("regroup")
    return Calibrations(recovery=None if rec is None else calibration_from_dict(rec[1], str(rec[0])),
                        overhead=None if ov is None else overhead_from_dict(ov[1], str(ov[0])),
                        overhead_missing=None if ov else missing,
                        regroup=None if rg is None else regroup_fit_from_dict(rg[1], str(rg[0])))


def _unbroken_phases(pol: Unbroken, cal: Calibration) -> dict[str, Any]:
    """Unbroken's phase parameters from the measured breakdown (or the scaled default model)."""
    depth = log2_scale(cal.ranks)
    b = cal.breakdown
    if not b:
        default_total = pol.detect_s + pol.decide_s + pol.regroup_per_log2_s * depth
        k = cal.unbroken_recovery_s / default_total if default_total > 0 else 1.0
        return {"detect_s": pol.detect_s * k, "decide_s": pol.decide_s * k,
                "regroup_per_log2_s": pol.regroup_per_log2_s * k}
    out: dict[str, Any] = {}
    for key, phase in (("detect_s", "detect"), ("decide_s", "decide")):
        if phase in b:
            out[key] = b[phase]
    if "regroup" in b:
        out["regroup_per_log2_s"] = b["regroup"] / depth
    if "rebuild" in b and cal.state_gb is not None:
        out["rebuild_bench_s_per_gb"] = b["rebuild"] / cal.state_gb
    return out


def calibrate(policy: Policy, cal: Calibration) -> Policy:
    """The policy with measured costs: every job relaunch from the baseline, unbroken's phases from its run."""
    restart = dataclasses.replace(policy.restart,
                                  relaunch_per_log2_s=cal.baseline_recovery_s / log2_scale(cal.ranks))
    changes: dict[str, Any] = {"restart": restart}
    if isinstance(policy, Unbroken):
        changes.update(_unbroken_phases(policy, cal))
        if cal.steps_redone is not None:
            changes["protect_every"] = max(1, round(cal.steps_redone))
    return dataclasses.replace(policy, **changes)
