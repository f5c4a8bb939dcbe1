"""Fault injection that cannot mislead: specs that can never fire are refused up front, and
specs that could fire but did not are named after the run (summary, CLI, report)."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from unbroken.config import RunConfig
from unbroken.detect.report import analyze, load_runs
from unbroken.detect.summary import to_markdown
from unbroken.runtime.command import print_summary
from unbroken.runtime.faults import (CHUNK_PHASES, KINDS, NODE_KINDS, PHASES, FaultSpec, check_reachable,
                                     faults_not_fired, unreachable_chunks)
from unbroken.runtime.run import summarize


def _points(*, steps: int, n_chunks: int, n_windows: int, checkpoint_every: int) -> set[tuple[str, int, int]]:
    """Every (phase, step, chunk) that worker.py's `_point` call sites can pass in a run of `steps`
    steps (an independent oracle: the call sites, not the rules in faults.py)."""
    pts = {("build", 1, 0), ("shadow", 1, 0), ("done", steps, 0)}  # done: finish(), after the last step
    pts |= {("recovery", t, 0) for t in range(1, steps + 2)}  # step_count + 1, also after the last step
    if checkpoint_every:
        pts |= {("checkpoint", t, 0) for t in range(0, steps + 1) if t % checkpoint_every == 0}
    for t in range(1, steps + 1):
        pts |= {(p, t, 0) for p in ("forward", "backward", "allreduce", "reduced", "allgather")}
        pts |= {(p, t, c) for p in ("optimizer", "midchunk") for c in range(n_chunks)}
        pts |= {("parity", t, w) for w in range(n_windows)}
    return pts


def _refused(spec: FaultSpec, **kw) -> str | None:
    try:
        check_reachable([spec], **kw)
    except ValueError as e:
        return str(e)
    return None


runs = st.fixed_dictionaries({"world_size": st.integers(1, 8), "steps": st.integers(1, 12),
                              "n_chunks": st.integers(1, 6), "tier1": st.booleans(),
                              "checkpoint_every": st.integers(0, 4)})
specs = st.builds(FaultSpec, kind=st.sampled_from(KINDS), rank=st.integers(0, 9), step=st.integers(0, 16),
                  phase=st.sampled_from(PHASES), chunk=st.integers(0, 7))


@settings(max_examples=400, deadline=None)
@given(runs, specs, st.integers(1, 4))
def test_refused_up_front_or_by_layout_exactly_when_no_call_site_can_fire_it(run, spec, n_windows):
    n_windows = n_windows if run["tier1"] else 0
    pts = _points(steps=run["steps"], n_chunks=run["n_chunks"], n_windows=n_windows,
                  checkpoint_every=run["checkpoint_every"])
    can_fire = ((spec.phase, spec.step, spec.chunk) in pts and spec.rank < run["world_size"]
                and (run["tier1"] or spec.kind != "bitflip"))  # no parity: a bitflip has nothing to flip
    why = _refused(spec, world_size=run["world_size"], steps=run["steps"], tier1=run["tier1"],
                   checkpoint_every=run["checkpoint_every"])
    late = unreachable_chunks([spec], n_chunks=run["n_chunks"], n_windows=n_windows)
    assert (why is None and not late) == can_fire, (why, late)
    for msg in filter(None, [why, *late]):
        assert msg.startswith(f"fault {spec} can never fire: ") and "\n" not in msg and "use " in msg


@settings(max_examples=200, deadline=None)
@given(specs, st.integers(1, 8))
def test_an_unknown_step_count_never_refuses_a_late_step(spec, world):
    """A script without --steps decides its own step count: no step is too late then."""
    why = _refused(spec, world_size=world, steps=None)
    if why is not None:
        assert "the run has" not in why
    if spec.rank < world and (spec.chunk == 0 or spec.phase in CHUNK_PHASES) and spec.step >= 1 \
            and (spec.phase not in ("build", "shadow") or spec.step == 1):
        assert why is None


@pytest.mark.parametrize("text,needle", [
    ("sigkill:rank=0,step=99", "the run has 5 steps; use step=1..5 or raise --steps"),
    ("sigkill:rank=4,step=2", "names rank 4 but the world has 4 ranks; use rank=0..3"),
    ("sigkill:rank=0,step=2,phase=backward,chunk=1", "phase backward has no chunks"),
    ("bitflip:rank=0,step=2,phase=forward,chunk=2", "use phase=parity,chunk=2"),
    ("sigkill:rank=0,step=0,phase=forward", "steps start at 1"),
    ("sigkill:rank=0,step=0,phase=build", "steps start at 1"),
    ("sigkill:rank=0,step=2,phase=build", "its step is always 1; use step=1"),
    ("sigkill:rank=1,step=3,phase=shadow", "its step is always 1; use step=1"),
    ("sigkill:rank=0,step=7,phase=recovery", "use step=1..6"),
    ("sigkill:rank=0,step=3,phase=checkpoint", "use a step that is a multiple of 2"),
    ("sigkill:rank=0,step=6,phase=checkpoint", "use step=0..5"),
    ("sigstop:rank=1,step=3,phase=done", "phase done runs once, after the last step (5); use step=5"),
])
def test_each_refusal_names_the_spec_and_the_fix(text, needle):
    spec = FaultSpec.parse(text)
    why = _refused(spec, world_size=4, steps=5, checkpoint_every=2)
    assert why is not None and why.startswith(f"fault {spec} can never fire: ") and needle in why, why


@pytest.mark.parametrize("text", [
    "sigkill:rank=3,step=5", "sigkill:rank=0,step=1,phase=build", "sigkill:rank=1,step=1,phase=shadow",
    "sigkill:rank=0,step=6,phase=recovery", "sigkill:rank=0,step=0,phase=checkpoint",
    "sigkill:rank=0,step=4,phase=checkpoint", "sigkill:rank=0,step=5,phase=optimizer,chunk=9",
    "sigkill:rank=0,step=5,phase=midchunk,chunk=3", "bitflip:rank=0,step=5,phase=parity,chunk=2",
    "bitflip:rank=0,step=2,phase=forward", "slow:rank=2,step=1,phase=forward,ms=50",
])
def test_specs_that_can_fire_are_accepted(text):
    assert _refused(FaultSpec.parse(text), world_size=4, steps=5, checkpoint_every=2) is None


def test_no_parity_and_no_checkpoints_refuse_what_needs_them():
    no_tier1 = dict(world_size=4, steps=5, tier1=False)
    assert "no tier-1 parity" in _refused(FaultSpec.parse("sigkill:rank=0,step=2,phase=parity"), **no_tier1)
    assert "no tier-1 parity" in _refused(FaultSpec.parse("bitflip:rank=0,step=2,phase=forward"), **no_tier1)
    off = _refused(FaultSpec.parse("sigkill:rank=0,step=0,phase=checkpoint"), world_size=4, steps=5,
                   checkpoint_every=0)
    assert "checkpoints are off (--checkpoint-every 0)" in off
    # the period unknown (None): not refused
    assert _refused(FaultSpec.parse("sigkill:rank=0,step=3,phase=checkpoint"), world_size=4, steps=5) is None


def test_the_first_unreachable_spec_is_named():
    ok, bad = FaultSpec.parse("sigkill:rank=0,step=2"), FaultSpec.parse("nan:rank=1,step=9")
    with pytest.raises(ValueError, match=r"^fault nan:rank=1,step=9,phase=backward,chunk=0 can never fire"):
        check_reachable([ok, bad, ok], world_size=2, steps=4)
    check_reachable([], world_size=1, steps=1)


def test_unreachable_chunks_by_phase():
    got = unreachable_chunks([FaultSpec.parse(t) for t in (
        "sigkill:rank=0,step=2,phase=optimizer,chunk=3",   # 3 chunks: 0..2 -> past the last
        "sigkill:rank=0,step=2,phase=midchunk,chunk=2",    # fine
        "sigkill:rank=0,step=2,phase=parity,chunk=2",      # 2 windows: 0..1 -> past the last
        "bitflip:rank=0,step=2,phase=optimizer,chunk=2",   # an optimizer chunk: fine (flips window 2 % 2)
        "bitflip:rank=0,step=2,phase=forward,chunk=4",     # a parity window: past the last
        "sigkill:rank=0,step=2,phase=backward")], n_chunks=3, n_windows=2)
    assert got == [
        "fault sigkill:rank=0,step=2,phase=optimizer,chunk=3 can never fire: chunk 3 is past the last of the 3 "
        "chunks each rank has; use chunk=0..2",
        "fault sigkill:rank=0,step=2,phase=parity,chunk=2 can never fire: chunk 2 is past the last of the 2 "
        "parity windows each rank has; use chunk=0..1",
        "fault bitflip:rank=0,step=2,phase=forward,chunk=4 can never fire: chunk 4 is past the last of the 2 "
        "parity windows each rank has; use chunk=0..1"]
    # no parity kept (n_windows 0): parity and bitflip chunks are not judged here (check_reachable does)
    assert unreachable_chunks([FaultSpec.parse("sigkill:rank=0,step=2,phase=parity,chunk=5")],
                              n_chunks=3, n_windows=0) == []


# --- which specs did not fire -------------------------------------------------------------

def injected(spec: FaultSpec, *, node: int | None = 1, rank_field: bool = False, chunk: bool = True) -> dict:
    """The `fault_injected` event worker.py's `_point` writes for `spec` (rank top-level)."""
    fields = {"fault": spec.kind, "phase": spec.phase, "step": spec.step}
    if chunk:
        fields["chunk"] = spec.chunk
    if rank_field:
        fields["rank"] = spec.rank
    return {"time": 1.0, "kind": "fault_injected", "rank": None if rank_field else spec.rank, "gen": 0,
            "node": node, "source": "worker", "fields": fields}


@settings(max_examples=200, deadline=None)
@given(st.lists(specs, max_size=8), st.data())
def test_not_fired_is_exactly_the_specs_without_an_event(all_specs, data):
    fired = [s for s in all_specs if data.draw(st.booleans())]
    missing = list(all_specs)
    for s in fired:
        missing.remove(s)
    noise = [{"kind": "step", "rank": 0, "fields": {"step": 1}},
             {"kind": "fault_detected", "rank": 1, "fields": {"fault": "crash"}}]
    evs = [injected(s) for s in fired] + noise
    random.Random(data.draw(st.integers(0, 99))).shuffle(evs)
    assert sorted(map(str, faults_not_fired(all_specs, evs))) == sorted(map(str, missing))


def test_not_fired_matching_rules():
    a = FaultSpec.parse("sigkill:rank=1,step=4,phase=optimizer,chunk=2")
    shadow = FaultSpec.parse("exception:rank=2,step=1,phase=shadow")  # fired in the shadow now holding rank 2
    assert faults_not_fired([a, shadow], [injected(a), injected(shadow)]) == []
    assert faults_not_fired([a], [injected(FaultSpec.parse("sigkill:rank=1,step=4,phase=optimizer,chunk=1"))]) == [a]
    assert faults_not_fired([a], [injected(FaultSpec.parse("sigkill:rank=2,step=4,phase=optimizer,chunk=2"))]) == [a]
    assert faults_not_fired([a], [injected(a, rank_field=True)]) == []          # rank only in the fields
    assert faults_not_fired([a, a], [injected(a)]) == [a]                       # one event, one spec
    # an older log without chunk matches any chunk, but only after the exact matches are taken
    b = FaultSpec.parse("sigkill:rank=1,step=4,phase=optimizer,chunk=0")
    assert faults_not_fired([b, a], [injected(a, chunk=False), injected(b)]) == []


@pytest.mark.parametrize("kind", NODE_KINDS)
def test_a_node_fault_claimed_on_node_0_did_not_fire(kind):
    """FaultInjector.fire skips a node fault on node 0 (the store's host): its event is no firing."""
    spec = FaultSpec.parse(f"{kind}:rank=3,step=4,phase=backward")
    assert faults_not_fired([spec], [injected(spec, node=1)]) == []
    assert faults_not_fired([spec], [injected(spec, node=0)]) == [spec]
    other = FaultSpec.parse("sigkill:rank=0,step=4,phase=backward")
    assert faults_not_fired([other], [injected(other, node=0)]) == []


def _write_run(run_dir, events: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps({"gen": 0, "source": "t", **e}) + "\n"
                                                  for e in events))


def test_summary_lists_the_specs_that_did_not_fire(tmp_path):
    fired = FaultSpec.parse("sigkill:rank=1,step=4,phase=optimizer,chunk=2")
    idle = FaultSpec.parse("sigkill:rank=0,step=3,phase=recovery")
    _write_run(tmp_path, [{"time": 1.0, "kind": "run_start", "fields": {}}, {**injected(fired), "time": 2.0}])
    s = summarize(RunConfig(), tmp_path, wall_s=1.0, faults=(fired, idle))
    assert s["faults_not_fired"] == ["sigkill:rank=0,step=3,phase=recovery,chunk=0"]
    assert summarize(RunConfig(), tmp_path, wall_s=1.0)["faults_not_fired"] == []


def test_print_summary_warns_about_faults_that_never_fired():
    console = Console(record=True, width=300)
    print_summary({"steps": 5, "faults_not_fired": ["sigkill:rank=0,step=3,phase=recovery,chunk=0"]}, console)
    out = console.export_text()
    assert "warning: 1 injected fault(s) never fired: sigkill:rank=0,step=3,phase=recovery,chunk=0" in out
    quiet = Console(record=True, width=300)
    print_summary({"steps": 5, "faults_not_fired": []}, quiet)
    assert "never fired" not in quiet.export_text()


def test_report_counts_injected_but_not_fired(tmp_path):
    evs = [{"time": 1.0, "kind": "run_start", "fields": {}}, {"time": 9.0, "kind": "run_end", "fields": {}}]
    _write_run(tmp_path / "a", evs)
    (tmp_path / "a" / "summary.json").write_text(json.dumps({"faults_not_fired": ["nan:rank=1,step=2,phase=x"]}))
    _write_run(tmp_path / "b", evs)
    (tmp_path / "b" / "summary.json").write_text(json.dumps({"faults_not_fired": []}))
    _write_run(tmp_path / "old", evs)  # no summary.json: not known, not counted
    r = analyze(load_runs([tmp_path / "a"]))
    assert r["not_fired"] == 1 and r["faults_not_fired"] == [{"run": "a", "fault": "nan:rank=1,step=2,phase=x"}]
    assert "| injected but not fired | 1 (nan:rank=1,step=2,phase=x) |" in to_markdown(r)
    both = analyze(load_runs([tmp_path / "a", tmp_path / "b"]))
    assert both["not_fired"] == 1 and "| injected but not fired | 1 (a: nan:rank=1,step=2,phase=x) |" in \
        to_markdown(both)
    assert analyze(load_runs([tmp_path / "b"]))["not_fired"] == 0
    old = analyze(load_runs([tmp_path / "old"]))
    assert "not_fired" not in old and "injected but not fired" not in to_markdown(old)


def test_the_step_count_is_known_when_given_or_for_the_built_in_job():
    from unbroken.config import build_config
    from unbroken.runtime.command import _check_faults_reachable
    late = [FaultSpec.parse("sigkill:rank=0,step=99")]
    with pytest.raises(ValueError, match="the run has 5 steps"):
        _check_faults_reachable(late, build_config(None, steps=5), builtin=False)   # --steps 5 with a script
    with pytest.raises(ValueError, match="the run has 60 steps"):
        _check_faults_reachable(late, build_config(None), builtin=True)             # the built-in job: cfg.steps
    _check_faults_reachable(late, build_config(None), builtin=False)               # a script decides its steps
    with pytest.raises(ValueError, match="no tier-1 parity"):
        _check_faults_reachable([FaultSpec.parse("bitflip:rank=0,step=2")], build_config(None, strategy="ddp"),
                                builtin=True)
    with pytest.raises(ValueError, match="checkpoints are off"):
        _check_faults_reachable([FaultSpec.parse("sigkill:rank=0,step=2,phase=checkpoint")],
                                build_config(None, checkpoint_every=0), builtin=True)
