"""A simulated run written as events.jsonl (the schema of unbroken/events.py) so `unbroken report` reads it.

One event per fault, classification and recovery phase; times are simulated seconds since
the run started. Phases the runtime does not have are logged under the nearest runtime
phase (wait -> decide, degraded -> rebuild) with the simulator's name in `sim_phase`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from unbroken.events import Event
from unbroken.fsutil import atomic_write_bytes
from unbroken.sim.cluster import Cluster
from unbroken.sim.engine import Incident, RunResult
from unbroken.sim.rates import FailureMix

RUNTIME_PHASE = {"detect": "detect", "decide": "decide", "wait": "decide", "regroup": "regroup",
                 "rebuild": "rebuild", "degraded": "rebuild"}
SOURCE = "sim"


def _ev(t: float, kind: str, *, rank: int | None = None, gen: int = 0, node: int | None = None,
        **fields: Any) -> Event:
    return Event(time=round(t, 3), kind=kind, rank=rank, gen=gen, node=node, source=SOURCE, fields=fields)


def _fault_events(inc: Incident, gen: int, mix: FailureMix, cluster: Cluster, wall_s: float) -> list[Event]:
    out = []
    detect_s = next((d for n, d in inc.plan if n == "detect"), 0.0)
    for t, ci, node, gpu, action in inc.faults:
        c = mix.classes[ci]
        rank, proc = node * cluster.node_size + gpu, f"n{node}-g{gpu}"
        seen = min(t + detect_s, inc.end, wall_s)
        out.append(_ev(seen, "fault_detected", rank=rank, gen=gen, node=node, fault=c.fault, proc=proc,
                       evidence=f"simulated {c.label or c.name}", occurred_at=round(t, 3)))
        reason = f"{c.name}: " + ("silent corruption reaches every copy" if c.corrupts_state else
                                  "node must be replaced" if c.kind == "replace" else "node stays in place")
        out.append(_ev(seen, "fault_classified", rank=rank, gen=gen, node=node, fault=c.fault, cls=c.kind,
                       action=action, reason=reason, proc=proc))
        if c.kind == "replace":
            out.append(_ev(seen, "node_excluded", rank=rank, gen=gen, node=node, faults=1, window_s=0.0))
    return out


def _incident_events(inc: Incident, gen: int, run: RunResult, nxt: float) -> list[Event]:
    """Phases, redo (clipped at the next incident) and `recovered` of one finished incident."""
    step = round(inc.restore * run.fast_interval_s / run.step_s)
    out = [_ev(e, "recovery_phase", gen=gen, phase=RUNTIME_PHASE[n], sim_phase=n, start=round(s, 3),
               end=round(e, 3), step=step) for n, s, e in inc.done]
    if not inc.finished:
        return out
    lost_s = inc.p_fail - inc.restore * run.fast_interval_s
    redo_end = min(inc.end + lost_s, nxt)
    steps_lost = round(lost_s / run.step_s)
    breakdown: dict[str, float] = {}
    for n, s, e in inc.done:
        breakdown[RUNTIME_PHASE[n]] = round(breakdown.get(RUNTIME_PHASE[n], 0.0) + e - s, 3)
    breakdown["redo"] = round(redo_end - inc.end, 3)
    if redo_end > inc.end:
        out.append(_ev(redo_end, "recovery_phase", gen=gen, phase="redo", start=round(inc.end, 3),
                       end=round(redo_end, 3), step=step))
    out.append(_ev(redo_end, "recovered", gen=gen, step=step, steps_lost=steps_lost, steps_redone=steps_lost,
                   recovery_s=round(redo_end - inc.start, 3), breakdown=breakdown, path=inc.tier))
    out.append(_ev(redo_end, "step", gen=gen, step=step + steps_lost, loss=None, step_s=run.step_s, tokens=None))
    return out


def run_events(run: RunResult, mix: FailureMix, cluster: Cluster, *, limit: int) -> list[Event]:
    """All events of a recorded run, at most `limit` (the last two say so and close the run)."""
    assert limit >= 3, limit
    events = [_ev(0.0, "run_start", config={"simulated": True, "policy": run.policy, "gpus": run.gpus,
                                            "node_size": cluster.node_size, "days": run.days, "seed": run.seed,
                                            "rates": mix.source},
                  world_size=run.gpus, nodes=cluster.nodes)]
    incs = run.incidents
    for gen, inc in enumerate(incs, 1):
        nxt = incs[gen].start if gen < len(incs) else run.wall_s
        batch = _fault_events(inc, gen, mix, cluster, run.wall_s) + _incident_events(inc, gen, run, nxt)
        if len(events) + len(batch) > limit - 2:
            events.append(_ev(inc.start, "warning", message=f"simulated event log truncated at incident {gen} "
                              f"of {len(incs)} (--events-limit {limit})"))
            break
        events.extend(batch)
    events.sort(key=lambda e: e.time)
    events.append(_ev(run.wall_s, "run_end", steps=int(run.time_s["productive"] // run.step_s),
                      wall_s=run.wall_s, weights_sha256=None, ok=True))
    return events


def write_events(path: str | Path, events: list[Event]) -> None:
    """Write atomically (temp + fsync + rename): a reader never sees half a simulated log."""
    atomic_write_bytes(path, "".join(e.to_json() + "\n" for e in events).encode())
