"""Per-recovery timing from a run's events: kill -> detect -> decide -> regroup -> rebuild -> redo.

kill: the `fault_injected` event (or the detection time when the fault was not ours);
detect: supervisor's `fault_detected`; decide: generation published; regroup: new
groups built; rebuild: state restored; redo: first step completed afterwards.
"""
from __future__ import annotations

from unbroken.events import Event


def recoveries(events: list[Event]) -> list[dict]:
    out = []
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
        resumed_step = rec[0].fields.get("step", 0) if rec else None
        redo = _end(later, "redo", gen_no)
        steps = [e for e in later if e.kind == "step" and resumed_step is not None and e.gen >= gen_no
                 and e.fields.get("step", 0) > resumed_step]
        done = redo if redo is not None else (steps[0].time if steps else None)
        marks = [kill_t, det.time, g.time, regroup, rebuild, done]
        if any(m is None for m in marks):
            out.append({"gen": gen_no, "complete": False, "fault": det.fields.get("fault")})
            continue
        out.append({
            "gen": gen_no, "complete": True, "fault": det.fields.get("fault"), "rank": det.rank,
            "path": rec[0].fields.get("path"), "resumed_at_step": resumed_step + 1,
            "steps_redone": rec[0].fields.get("steps_redone", 0),
            "detect_s": det.time - kill_t, "decide_s": g.time - det.time, "regroup_s": regroup - g.time,
            "rebuild_s": rebuild - regroup, "redo_s": done - rebuild, "recovery_s": done - kill_t,
        })
    return out


def _end(events: list[Event], phase: str, gen: int) -> float | None:
    ends = [e.fields["end"] for e in events if e.kind == "recovery_phase" and e.fields.get("phase") == phase
            and e.gen == gen]
    return max(ends) if ends else None
