"""The operational report: from events.jsonl (real or simulated runs) to one JSON-able dict.

Owns the accounting rules: fault matching, detection latency, false positives,
recovery time split, ETTR and per-node offenders (all documented in docs/detect.md).
"""
from __future__ import annotations

import json
import math
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from unbroken.events import Event, read_events

# An injected fault and its detection are matched when the detection follows within this window.
MATCH_WINDOW_S = 30.0
SPLIT = {"detect": "detect", "decide": "diagnose", "regroup": "recover", "rebuild": "recover", "redo": "recover"}
_DAY_S = 86400.0


@dataclass(frozen=True)
class RunLog:
    """The events of one run: a run directory, or one run_start-delimited part of its file."""

    name: str
    events: list[Event]
    # injected specs that never fired (summary.json's faults_not_fired); None: not known
    not_fired: tuple[str, ...] | None = None


def find_event_files(path: Path) -> list[Path]:
    """events.jsonl of a run dir (or the file itself), else those of its immediate subdirs."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"run directory {path} does not exist; "
                                f"pass a directory written by a run or simulation")
    if (path / "events.jsonl").is_file():
        return [path / "events.jsonl"]
    found = sorted(p for p in path.glob("*/events.jsonl") if p.is_file())
    if not found:
        raise FileNotFoundError(f"no events.jsonl in {path} or its subdirectories; is this a run directory?")
    return found


def load_runs(paths: Iterable[Path]) -> list[RunLog]:
    """Read every run under `paths`; a file holding several runs is split at each run_start.

    Malformed lines are skipped by `read_events` with a warning naming file:line.
    """
    runs: list[RunLog] = []
    for path in paths:
        for f in find_event_files(Path(path)):
            name = f.parent.name if f.name == "events.jsonl" else f.stem
            parts = _split_runs(read_events(f.parent if f.name == "events.jsonl" else f))  # + other nodes'
            unfired = _not_fired_of(f.parent / "summary.json") if f.name == "events.jsonl" else None
            for i, part in enumerate(parts):  # the summary is the last run's: the one that wrote it
                runs.append(RunLog(name if len(parts) == 1 else f"{name}#{i}", part,
                                   unfired if i == len(parts) - 1 else None))
    return runs


def _not_fired_of(summary: Path) -> tuple[str, ...] | None:
    """summary.json's faults_not_fired; None when there is no summary or it predates the field."""
    if not summary.is_file():
        return None
    try:
        got = json.loads(summary.read_text()).get("faults_not_fired")
    except (OSError, ValueError, AttributeError) as e:
        warnings.warn(f"{summary}: unreadable summary, its faults_not_fired is not counted ({e})", stacklevel=2)
        return None
    return tuple(map(str, got)) if isinstance(got, list) else None


def _split_runs(events: list[Event]) -> list[list[Event]]:
    parts: list[list[Event]] = [[]]
    for ev in events:
        if ev.kind == "run_start" and any(e.kind == "run_start" for e in parts[-1]):
            parts.append([])
        parts[-1].append(ev)
    return [p for p in parts if p]


def as_num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def as_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _rank(ev: Event) -> int | None:
    r = as_int(ev.rank)
    return r if r is not None else as_int(ev.fields.get("rank"))


def _node(ev: Event) -> int | None:
    # The emitting supervisor's node is the event's; a `node` field names the faulty one.
    n = as_int(ev.fields.get("node"))
    return n if n is not None else as_int(ev.node)


def _union(intervals: Iterable[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def run_bounds(events: list[Event]) -> tuple[float, float]:
    """(start, end) of a run: run_start -> run_end, else first -> last event."""
    starts = [e.time for e in events if e.kind == "run_start"]
    ends = [e.time for e in events if e.kind == "run_end"]
    return (starts[0] if starts else events[0].time), (ends[-1] if ends else events[-1].time)


def steps_lost_by_gen(events: list[Event]) -> dict[int, int | None]:
    """Per generation: committed steps whose update is not in the state training resumed from.

    A generation resumes at its first `recovered` or `tier2_restore` event, from the lowest
    step they name (a deferred decode can roll back to tier 2 after `recovered`). Committed
    then: the highest `step` event since the previous resumption (or that resumption's step),
    whichever rank, whichever generation emitted it (a rank may commit a step its failed
    peer never did). Counting from the previous resumption counts a rolled-back step once
    per rollback that undid it. A `recovered` event's own `steps_lost` is a lower bound
    (simulated runs log no step events; the runtime's is 0: tier 1 never goes back), so the
    larger of the two counts. None: the generation never resumed (a later one that did
    accounts for its steps, or the job ended in it).
    """
    evs = sorted(events, key=lambda e: e.time)
    lost: dict[int, int | None] = {
        g: None for e in evs if e.kind == "generation" and (g := as_int(e.fields.get("gen"))) is not None and g > 0}
    resumed: dict[int, list] = {}  # gen -> [first resumption time, lowest step, steps_lost it claims]
    for e in evs:
        step = as_int(e.fields.get("step"))
        if e.kind in ("recovered", "tier2_restore") and step is not None and e.gen > 0:
            r = resumed.setdefault(e.gen, [e.time, step, 0])
            r[1] = min(r[1], step)
            r[2] = max(r[2], as_int(e.fields.get("steps_lost")) or 0)
    order = sorted(resumed.items(), key=lambda kv: kv[1][0])
    i, top = 0, 0  # top: the newest committed step since the last resumption (or its step)
    for e in [*evs, None]:
        while i < len(order) and (e is None or order[i][1][0] <= e.time):
            gen, (_, step, claimed) = order[i]
            lost[gen] = max(0, top - step, claimed)
            i, top = i + 1, step
        if e is not None and e.kind == "step" and (s := as_int(e.fields.get("step"))) is not None:
            top = max(top, s)
    return lost


def recovery_intervals(events: list[Event], start: float, end: float) -> list[tuple[str, float, float]]:
    """(split category, start, end) of every well-formed recovery_phase event, clipped to the run."""
    out = []
    for ev in events:
        phase = ev.fields.get("phase")
        if ev.kind != "recovery_phase" or not isinstance(phase, str) or phase not in SPLIT:
            continue
        s, e = as_num(ev.fields.get("start")), as_num(ev.fields.get("end"))
        if s is not None and e is not None and e >= s:
            s, e = max(s, start), min(e, end)
            if e > s:
                out.append((SPLIT[phase], s, e))
    return out


class _FaultWalk:
    """Walks one run's events in time order, pairing detections with injections,
    classifications and recoveries."""

    def __init__(self, run: RunLog, start: float, window_s: float) -> None:
        self.run, self.start, self.window_s = run, start, window_s
        evs = run.events
        self.ground_truth = any(e.kind == "fault_injected" for e in evs) or any(
            e.kind == "fault_detected" and as_num(e.fields.get("occurred_at")) is not None for e in evs)
        self.injections: list[Event] = []
        self.faults: list[dict[str, Any]] = []
        self.open: list[dict[str, Any]] = []
        self.steps_redone = 0
        self.redo_s = 0.0          # step time thrown away by recoveries that logged no redo phase
        self._saw_redo = False
        step_times = [x for e in evs if e.kind == "step" and (x := as_num(e.fields.get("step_s"))) is not None]
        self._step_s = statistics.median(step_times) if step_times else 0.0

    def walk(self) -> "_FaultWalk":
        handlers = {"fault_injected": self.injections.append, "fault_detected": self._detected,
                    "fault_classified": self._classified, "recovered": self._recovered,
                    "recovery_phase": self._phase, "shadow_assigned": self._shadow}
        for ev in self.run.events:
            h = handlers.get(ev.kind)
            if h is not None:
                h(ev)
        return self

    def _match_injection(self, ev: Event, rank: int | None) -> Event | None:
        for inj in self.injections:
            r = _rank(inj)
            if 0 <= ev.time - inj.time <= self.window_s and (r is None or rank is None or r == rank):
                self.injections.remove(inj)
                return inj
        return None

    def _detected(self, ev: Event) -> None:
        rank, node = _rank(ev), _node(ev)
        occurred = as_num(ev.fields.get("occurred_at"))
        if occurred is None and (inj := self._match_injection(ev, rank)) is not None:
            occurred = inj.time
            node = node if node is not None else _node(inj)
        fp = occurred is None and self.ground_truth and not any(
            f["rank"] == rank for f in self.open)  # a follow-up on an open incident is not a false alarm
        f = {"run": self.run.name, "class": str(ev.fields.get("fault", "unknown")), "cls": None,
             "rank": rank, "node": node, "proc": ev.fields.get("proc"), "time_s": ev.time - self.start,
             "detected_after_s": None if occurred is None else ev.time - occurred,
             "action": None, "recovered_s": None, "shadow": None, "false_positive": fp, "_t": ev.time}
        self.faults.append(f)
        if not fp:
            self.open.append(f)

    def _classified(self, ev: Event) -> None:
        fault, proc, rank = ev.fields.get("fault"), ev.fields.get("proc"), _rank(ev)
        for f in self.faults:
            if f["cls"] is not None or f["action"] is not None or (fault is not None and f["class"] != fault):
                continue
            if (proc and f["proc"] and proc != f["proc"]) or (not (proc and f["proc"]) and rank != f["rank"]):
                continue
            f["cls"], f["action"] = ev.fields.get("cls"), ev.fields.get("action")
            if ev.fields.get("false_positive") is True:
                f["false_positive"] = True
            if (f["false_positive"] or f["action"] == "none") and f in self.open:
                self.open.remove(f)
            return

    def _phase(self, ev: Event) -> None:
        if ev.fields.get("phase") == "redo":
            self._saw_redo = True

    def _shadow(self, ev: Event) -> None:
        """The open incidents' replacement: "cold" (not ready when assigned) wins over "warm"."""
        kind = ev.fields.get("shadow") or ("cold" if ev.fields.get("cold") else "warm")
        for f in self.open:
            f["shadow"] = "cold" if "cold" in (kind, f["shadow"]) else "warm"

    def _recovered(self, ev: Event) -> None:
        for f in self.open:
            f["recovered_s"] = ev.time - f["_t"]
        self.open.clear()
        redone = as_int(ev.fields.get("steps_redone")) or 0
        self.steps_redone += redone
        if not self._saw_redo:
            self.redo_s += redone * self._step_s
        self._saw_redo = False


def _analyze_run(run: RunLog, window_s: float) -> dict[str, Any]:
    start, end = run_bounds(run.events)
    walk = _FaultWalk(run, start, window_s).walk()
    intervals = recovery_intervals(run.events, start, end)
    split = {c: _union((s, e) for cat, s, e in intervals if cat == c) for c in ("detect", "diagnose", "recover")}
    wall = max(0.0, end - start)
    productive = max(0.0, wall - _union((s, e) for _, s, e in intervals) - walk.redo_s)
    ends = [e for e in run.events if e.kind == "run_end"]
    steps = as_int(ends[-1].fields.get("steps")) if ends else None
    if steps is None:
        done = [s + 1 for e in run.events if e.kind == "step" and (s := as_int(e.fields.get("step"))) is not None]
        steps = max(done, default=0)
    return {"run": run.name, "wall_s": wall, "productive_s": productive,
            "ettr": productive / wall if wall > 0 else None, "steps": steps,
            "faults": walk.faults, "missed": len(walk.injections), "split": split, "not_fired": run.not_fired,
            "steps_redone": walk.steps_redone,
            "steps_lost": sum(n for n in steps_lost_by_gen(run.events).values() if n is not None),
            "excluded": sorted({n for e in run.events if e.kind == "node_excluded" and (n := _node(e)) is not None}),
            "retry_events": [e for e in run.events if e.kind == "retry"],
            "stragglers": [_straggler(e, start) for e in run.events if e.kind == "straggler"],
            "collective_plans": [_plan(e, start, run.name) for e in run.events
                                 if e.kind in ("collective_plan", "collective_plan_rejected")]}


def _plan(ev: Event, start: float, run: str) -> dict[str, Any]:
    """A re-planned all-reduce (comm/adaptive.py): from which collective, what pattern, around which links;
    or a plan rejected ("rejected ...": it ran slower than the ring it replaced, or its slow links cleared)."""
    plan = ev.fields.get("plan") if isinstance(ev.fields.get("plan"), dict) else {}
    kind = f"{plan.get('kind')} paced" if plan.get("window") else plan.get("kind")  # every send in turn
    if plan.get("squeeze"):  # those ranks' transfers compressed (comm/squeeze.py)
        kind = f"{kind}, squeezing rank(s) {', '.join(map(str, plan['squeeze']))}"
    if ev.kind == "collective_plan_rejected":
        why = f"{_secs(ev.fields.get('seconds'))} vs the ring's {_secs(ev.fields.get('previous_seconds'))}" \
            if ev.fields.get("seconds") is not None else ev.fields.get("why")
        kind = f"rejected {kind} ({why})"
    return {"run": run, "time_s": ev.time - start, "seq": as_int(ev.fields.get("seq")), "kind": kind,
            "split": plan.get("split"), "congested": ev.fields.get("congested") or [],
            "contended": ev.fields.get("contended") or []}


def _secs(x: Any) -> str:
    v = as_num(x)
    return f"{v:.3f} s" if v is not None else "?"


def _straggler(ev: Event, start: float) -> dict[str, Any]:
    r = as_int(ev.fields.get("rank"))
    return {"rank": r if r is not None else _rank(ev), "node": _node(ev), "time_s": ev.time - start,
            "ratio": as_num(ev.fields.get("ratio")), "median_s": as_num(ev.fields.get("median_s"))}


def retry_summary(events: list[Event]) -> dict[str, Any]:
    """Retry chains (a chain starts at attempt 1): how many, links, how many ended in success."""
    chains: list[list[Event]] = []
    for ev in events:
        if as_int(ev.fields.get("attempt")) == 1 or not chains:
            chains.append([])
        chains[-1].append(ev)
    ok = sum(1 for c in chains if any(e.fields.get("outcome") == "ok" for e in c))
    return {"chains": len(chains), "links": len(events), "succeeded": ok,
            "success_rate": ok / len(chains) if chains else None}


def offenders(faults: list[dict[str, Any]], excluded: set[int]) -> list[dict[str, Any]]:
    """Per node: real (not false-positive) faults, their share, by class, and exclusion; worst first."""
    real = [f for f in faults if not f["false_positive"] and f["node"] is not None]
    rows: dict[int, dict[str, Any]] = {}
    for f in real:
        row = rows.setdefault(f["node"], {"node": f["node"], "faults": 0, "by_class": {}})
        row["faults"] += 1
        row["by_class"][f["class"]] = row["by_class"].get(f["class"], 0) + 1
    for n in excluded:
        rows.setdefault(n, {"node": n, "faults": 0, "by_class": {}})
    for row in rows.values():
        row["share"] = row["faults"] / len(real) if real else 0.0
        row["excluded"] = row["node"] in excluded
        row["by_class"] = dict(sorted(row["by_class"].items()))
    return sorted(rows.values(), key=lambda r: (-r["faults"], r["node"]))


def _latency(faults: list[dict[str, Any]]) -> dict[str, Any]:
    xs = [f["detected_after_s"] for f in faults if f["detected_after_s"] is not None and not f["false_positive"]]
    if not xs:
        return {"count": 0, "mean": None, "median": None, "max": None}
    return {"count": len(xs), "mean": statistics.fmean(xs), "median": statistics.median(xs), "max": max(xs)}


def pool_changes(events: list[Event]) -> list[dict[str, Any]]:
    """Pool sizes over time in a run that has pools (RL post-training: rl_pools at the start, then
    every rl_move, rl_requeue and rl_redo), seconds from the first event; empty for other runs."""
    kinds = ("rl_pools", "rl_move", "rl_requeue", "rl_redo")
    mine = [e for e in events if e.kind in kinds]
    if not mine:
        return []
    t0, out = events[0].time, []
    rollout = train = None
    for e in mine:
        f = e.fields
        rollout, train = f.get("rollout", rollout), f.get("train", train)
        why = {"rl_pools": f"start ({f.get('method')}, staleness {f.get('staleness')})",
               "rl_move": f"process {f.get('proc')}: {f.get('from_pool')} -> {f.get('to_pool')}: {f.get('reason')}",
               "rl_requeue": f"process {f.get('proc')} lost: {len(f.get('prompts') or [])} prompt(s) requeued",
               "rl_redo": f"trainer(s) {f.get('proc')} lost: step redone"}[e.kind]
        out.append({"t": e.time - t0, "step": f.get("step"), "rollout": rollout, "train": train,
                    "train_gen": f.get("train_gen"), "what": why})
    return out


def analyze(runs: list[RunLog], *, match_window_s: float = MATCH_WINDOW_S) -> dict[str, Any]:
    """The whole report as one JSON-able dict (floats rounded to 4 decimals)."""
    per = [_analyze_run(r, match_window_s) for r in runs if r.events]
    faults = [f for p in per for f in p["faults"]]
    for f in faults:
        f.pop("_t", None)
    wall = sum(p["wall_s"] for p in per)
    productive = sum(p["productive_s"] for p in per)
    fps = sum(1 for f in faults if f["false_positive"])
    by_class: dict[str, int] = {}
    for f in faults:
        if not f["false_positive"]:
            by_class[f["class"]] = by_class.get(f["class"], 0) + 1
    excluded = {n for p in per for n in p["excluded"]}
    report = {
        "runs": [{k: p[k] for k in ("run", "wall_s", "productive_s", "ettr", "steps")}
                 | {"faults": len(p["faults"]), "false_positives": sum(f["false_positive"] for f in p["faults"])}
                 for p in per],
        "ettr": productive / wall if wall > 0 else None, "wall_s": wall, "productive_s": productive,
        "faults": faults, "faults_by_class": dict(sorted(by_class.items())),
        "missed": sum(p["missed"] for p in per), "detection_latency_s": _latency(faults),
        "time_split_s": {c: sum(p["split"][c] for p in per) for c in ("detect", "diagnose", "recover")},
        "steps_redone": sum(p["steps_redone"] for p in per), "steps_lost": sum(p["steps_lost"] for p in per),
        "false_positives": fps, "false_positives_per_day": fps / (wall / _DAY_S) if wall > 0 else None,
        "retries": retry_summary([e for p in per for e in p["retry_events"]]),
        "offenders": offenders(faults, excluded), "excluded_nodes": sorted(excluded),
        "stragglers": [s for p in per for s in p["stragglers"]],
        "collective_plans": [c for p in per for c in p["collective_plans"]],
    }
    pools = [c for r in runs for c in pool_changes(r.events)]
    if pools:
        report["pools"] = pools
    known = [p for p in per if p["not_fired"] is not None]
    if known:  # only runs whose summary.json lists them know which injected specs never fired
        report["faults_not_fired"] = [{"run": p["run"], "fault": f} for p in known for f in p["not_fired"]]
        report["not_fired"] = len(report["faults_not_fired"])
    return _rounded(report)


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x
