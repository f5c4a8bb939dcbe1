"""Per-recovery timing from a run's events: kill -> detect -> decide -> regroup -> rebuild -> redo.

kill: the `fault_injected` event (or the detection time when the fault was not ours);
detect: supervisor's `fault_detected`; decide: generation published; regroup: new
groups built; rebuild: state restored; redo: first step completed afterwards. Each record
also carries the steps it lost (`detect.report.steps_lost_by_gen`) and whether its
replacement was a warm shadow or had to start cold.
"""
from __future__ import annotations

from unbroken.detect.report import steps_lost_by_gen
from unbroken.events import Event


def recoveries(events: list[Event]) -> list[dict]:
    out = []
    lost = steps_lost_by_gen(events)
    gens = [e for e in events if e.kind == "generation" and e.fields.get("gen", 0) > 0]
    for g in gens:
        before = [e for e in events if e.time <= g.time]
        detected = [e for e in before if e.kind == "fault_detected"]
        if not detected:
            continue
        det = detected[-1]
        inj = [e for e in before if e.kind == "fault_injected" and e.time <= det.time]
        kill_t = inj[-1].time if inj and det.time - inj[-1].time < 60 else det.time
        gen_no = g.fields["gen"]
        later = [e for e in events if e.time >= g.time]
        regroup = _end(later, "regroup", gen_no)
        rebuild = _end(later, "rebuild", gen_no)
        rec = [e for e in later if e.kind == "recovered" and e.gen == gen_no]
        restored = [e for e in later if e.kind == "tier2_restore" and e.gen == gen_no]
        resumed = [e.fields.get("step", 0) for e in rec + restored]
        resumed_step = min(resumed) if resumed else None  # a deferred decode may roll back after `recovered`
        redo = _end(later, "redo", gen_no)
        steps = [e for e in later if e.kind == "step" and resumed_step is not None and e.gen >= gen_no
                 and e.fields.get("step", 0) > resumed_step]
        done = redo if redo is not None else (steps[0].time if steps else None)
        marks = [kill_t, det.time, g.time, regroup, rebuild, done]
        if any(m is None for m in marks):
            out.append({"gen": gen_no, "complete": False, "fault": det.fields.get("fault"),
                        "steps_lost": lost.get(gen_no)})
            continue
        out.append({
            "gen": gen_no, "complete": True, "fault": det.fields.get("fault"), "rank": det.rank,
            "path": "tier2" if restored else rec[0].fields.get("path"), "resumed_at_step": resumed_step + 1,
            "steps_redone": rec[0].fields.get("steps_redone", 0) if rec else 0, "steps_lost": lost.get(gen_no),
            "shadow": _shadow(events, gen_no),
            "detect_s": det.time - kill_t, "decide_s": g.time - det.time, "regroup_s": regroup - g.time,
            "rebuild_s": rebuild - regroup, "redo_s": done - rebuild, "recovery_s": done - kill_t,
        })
    return out


def steps_lost_total(events: list[Event]) -> int | None:
    """Steps lost by all recoveries; None while the newest one has not resumed training (its
    loss is unknown). A generation superseded before it resumed lost nothing itself: the one
    that resumed counts from the last committed step."""
    lost = steps_lost_by_gen(events)
    if lost and lost[max(lost)] is None:
        return None
    return sum(n for n in lost.values() if n is not None)


def segments(events: list[Event]) -> list[list[Event]]:
    """A run directory's events split at each `run_start`: the first run, then each --resume."""
    starts = [e.time for e in events if e.kind == "run_start"]
    out: list[list[Event]] = [[] for _ in starts] or [[]]
    for e in events:
        i = sum(1 for t in starts if t <= e.time) - 1
        out[max(i, 0)].append(e)
    return out


def resumes(events: list[Event]) -> list[dict]:
    """Each `unbroken run --resume` of this run directory: the newest step any rank had
    completed before the job stopped, the checkpoint step it resumed from, the steps lost."""
    out = []
    parts = segments(events)
    for before, seg in zip(parts, parts[1:]):
        done = [s for e in before if e.kind == "step" and (s := e.fields.get("step")) is not None]
        restored = [e.fields["step"] for e in seg if e.kind == "tier2_restore" and e.fields.get("reason") == "resume"]
        top, start = max(done, default=0), min(restored, default=None)
        out.append({"from_step": start, "stopped_after_step": top,
                    "steps_lost": None if start is None else max(0, top - start)})
    return out


def _shadow(events: list[Event], gen: int) -> str | None:
    """"cold" if a replacement of this generation was not ready when assigned (the recovery
    waited for its start-up), "warm" if every one was; None when nobody was replaced."""
    kinds = [e.fields.get("shadow") or ("cold" if e.fields.get("cold") else "warm")
             for e in events if e.kind == "shadow_assigned" and e.fields.get("gen") == gen]
    return None if not kinds else ("cold" if "cold" in kinds else "warm")


def _end(events: list[Event], phase: str, gen: int) -> float | None:
    ends = [e.fields["end"] for e in events if e.kind == "recovery_phase" and e.fields.get("phase") == phase
            and e.gen == gen]
    return max(ends) if ends else None
