"""`unbroken report`: golden output on a recorded events file, bad input, CLI errors, accounting rules."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from unbroken.detect.command import report
from unbroken.detect.report import analyze, load_runs
from unbroken.events import Event

GOLDEN = Path(__file__).parents[1] / "data" / "report_golden"


@pytest.fixture
def cli():
    app = typer.Typer()
    app.command()(report)
    return lambda *args: CliRunner().invoke(app, [str(a) for a in args])


def _write(path: Path, events: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def ev(t: float, kind: str, rank=None, node=None, **fields) -> dict:
    return {"time": 1000.0 + t, "kind": kind, "rank": rank, "gen": 0, "node": node, "source": "test",
            "fields": fields}


def test_golden_report_json(cli, tmp_path):
    expected = json.loads((GOLDEN / "expected.json").read_text())
    assert analyze(load_runs([GOLDEN])) == {k: v for k, v in expected.items() if k != "skipped_lines"}
    res = cli(GOLDEN, "--json", "--out", tmp_path)
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout) == expected                       # exactly one JSON object on stdout
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text()
    assert "| ETTR (productive / wall) | 88.8% |" in md and "| 1 | 2 | 66.7% | crash 1, straggler 1 | excluded |" in md


def test_golden_headline_numbers_are_the_hand_computed_ones():
    r = json.loads((GOLDEN / "expected.json").read_text())
    # wall 20 s; recovery phases 0.40 + 0.78 + 0.80 s; the hang's redone step (no redo phase) 0.25 s
    assert r["ettr"] == round((20.0 - 0.40 - 0.78 - 0.80 - 0.25) / 20.0, 4)
    assert [(f["class"], f["detected_after_s"], f["action"], f["false_positive"]) for f in r["faults"]] == [
        ("crash", 0.055, "in_place", False), ("hang", 0.19, "in_place", False),
        ("hang", None, "none", True), ("straggler", 8.0, "exclude_node", False)]
    assert r["time_split_s"] == {"detect": 0.235, "diagnose": 0.027, "recover": 1.718}
    assert r["retries"] == {"chains": 2, "links": 3, "succeeded": 2, "success_rate": 1.0}


def test_truncated_last_line_is_skipped_with_a_warning_naming_it(cli, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(GOLDEN, run)
    lines = (GOLDEN / "events.jsonl").read_text().splitlines(keepends=True)
    # the job was killed mid-write: the run_end line is cut in half
    (run / "events.jsonl").write_text("".join(lines[:-1]) + lines[-1][:40])
    res = cli(run, "--json")
    assert res.exit_code == 0
    assert f"events.jsonl:{len(lines)}: skipped a malformed event line" in res.stderr
    out = json.loads(res.stdout)
    assert out["skipped_lines"] == 1 and len(out["faults"]) == 4
    assert out["wall_s"] == 19.8                                     # no run_end: ends at the last event


def test_missing_run_dir_or_events_file_exits_2(cli, tmp_path):
    res = cli(tmp_path / "nope")
    assert res.exit_code == 2 and res.stderr.startswith("error: ") and "does not exist" in res.stderr
    (tmp_path / "empty").mkdir()
    res = cli(tmp_path / "empty")
    assert res.exit_code == 2 and "no events.jsonl" in res.stderr and res.stderr.count("\n") == 1


def test_report_is_registered_on_the_unbroken_cli(tmp_path):
    from unbroken.cli import app
    res = CliRunner().invoke(app, ["report", str(tmp_path / "nope")])
    assert res.exit_code == 2 and res.stderr.startswith("error: ")


def test_human_output_and_files_in_the_run_dir(cli, tmp_path):
    run = shutil.copytree(GOLDEN, tmp_path / "run")
    res = cli(run)
    assert res.exit_code == 0 and "ETTR" in res.stdout and "straggler" in res.stdout
    assert (run / "timeline.png").exists() and (run / "report.md").exists()


def test_several_runs_and_a_file_holding_several_runs(tmp_path):
    a = _write(tmp_path / "a", [ev(0, "run_start"), ev(1, "fault_injected", rank=0, node=5),
                                ev(1.5, "fault_detected", rank=0, fault="crash", proc="w0", node=5),
                                ev(2, "recovered", steps_redone=0), ev(10, "run_end", steps=5)])
    b = _write(tmp_path / "b", [ev(100, "run_start"), ev(101, "fault_detected", rank=1, fault="hang", node=5,
                                                         occurred_at=1100.8),
                                ev(110, "run_end"), ev(200, "run_start"), ev(220, "run_end")])
    r = analyze(load_runs([a, b]))
    assert [x["run"] for x in r["runs"]] == ["a", "b#0", "b#1"]
    assert r["wall_s"] == 40.0 and r["ettr"] == 1.0
    assert [f["detected_after_s"] for f in r["faults"]] == [0.5, 0.2]
    assert r["offenders"] == [{"node": 5, "faults": 2, "by_class": {"crash": 1, "hang": 1}, "share": 1.0,
                               "excluded": False}]
    assert analyze(load_runs([tmp_path])) == r                       # a directory of run directories


def test_false_positive_rules(tmp_path):
    # with ground truth (an injection): an unmatched detection is a false positive, and
    # a follow-up detection on the rank of an open incident is not
    gt = _write(tmp_path / "gt", [
        ev(0, "run_start"), ev(1, "fault_injected", rank=2), ev(1.2, "fault_detected", rank=2, fault="hang"),
        ev(1.3, "fault_detected", rank=2, fault="crash"), ev(2, "recovered"),
        ev(50, "fault_detected", rank=1, fault="stall"), ev(60, "fault_injected", rank=3), ev(99, "run_end")])
    r = analyze(load_runs([gt]))
    assert [(f["class"], f["false_positive"]) for f in r["faults"]] == [
        ("hang", False), ("crash", False), ("stall", True)]
    assert r["false_positives"] == 1 and r["missed"] == 1
    # without ground truth only an explicit mark makes a false positive
    real = _write(tmp_path / "real", [
        ev(0, "run_start"), ev(5, "fault_detected", rank=1, fault="hang", proc="w1"),
        ev(5.1, "fault_classified", rank=1, fault="hang", proc="w1", action="none", false_positive=True),
        ev(6, "fault_detected", rank=0, fault="straggler", proc="w0"), ev(9, "run_end")])
    r = analyze(load_runs([real]))
    assert [(f["class"], f["false_positive"]) for f in r["faults"]] == [("hang", True), ("straggler", False)]


def test_redone_steps_count_once_whether_or_not_a_redo_phase_was_logged(tmp_path):
    steps = [ev(0.5 * i, "step", rank=0, step=i, step_s=0.5) for i in range(1, 20)]
    with_redo = _write(tmp_path / "x", [ev(0, "run_start"), *steps,
                                        ev(5, "recovery_phase", phase="redo", start=1004.0, end=1005.0),
                                        ev(5, "recovered", steps_redone=2), ev(10, "run_end")])
    without = _write(tmp_path / "y", [ev(0, "run_start"), *steps, ev(5, "recovered", steps_redone=2),
                                      ev(10, "run_end")])
    assert analyze(load_runs([with_redo]))["productive_s"] == 9.0
    assert analyze(load_runs([without]))["productive_s"] == 9.0


kinds = st.sampled_from(["run_start", "run_end", "step", "fault_injected", "fault_detected", "fault_classified",
                         "recovery_phase", "recovered", "retry", "node_excluded", "straggler", "made_up"])
junk = st.none() | st.booleans() | st.integers(-5, 5) | st.floats() | st.text(max_size=4) | st.lists(
    st.integers(), max_size=2)
field_names = st.sampled_from(["fault", "rank", "node", "proc", "phase", "start", "end", "steps_redone",
                               "steps_lost", "step_s", "attempt", "outcome", "occurred_at", "false_positive",
                               "action", "cls", "ratio", "steps"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.floats(0, 100), kinds, junk, junk, st.dictionaries(field_names, junk, max_size=5)),
                min_size=1, max_size=25))
def test_report_never_crashes_on_odd_field_values(raw):
    from unbroken.detect.report import RunLog
    events = sorted((Event(time=t, kind=k, rank=r, node=n, fields=f) for t, k, r, n, f in raw),
                    key=lambda e: e.time)
    r = analyze([RunLog("fuzz", events)])
    json.dumps(r)
    assert r["ettr"] is None or 0.0 <= r["ettr"] <= 1.0


def test_a_replanned_all_reduce_is_listed_with_its_pattern_and_links(cli, tmp_path):
    plan = {"kind": "pipelined", "order": [0, 1, 2, 3], "split": [333, 0, 333, 333], "pieces": 8, "aggregators": []}
    run = _write(tmp_path / "run", [ev(0, "run_start"), ev(1.5, "collective_plan", rank=0, seq=7, plan=plan,
                                                          congested=["up:1", "down:1"], contended=["up:3"]),
                                    ev(3, "run_end", steps=5)])
    [p] = analyze(load_runs([run]))["collective_plans"]
    assert (p["time_s"], p["seq"], p["kind"], p["split"], p["congested"]) == (1.5, 7, "pipelined",
                                                                               [333, 0, 333, 333], ["up:1", "down:1"])
    res = cli(run, "--out", tmp_path / "out")
    assert res.exit_code == 0 and "All-reduce re-plans" in res.stdout and "up:1, down:1" in res.stdout
    assert p["contended"] == ["up:3"]
    paced = {**plan, "kind": "ring", "split": [1, 1, 1, 1], "window": 4}  # the links cleared: the ring, paced
    back = _write(tmp_path / "back", [ev(0, "run_start"), ev(2, "collective_plan", rank=0, seq=9, plan=paced),
                                      ev(3, "run_end", steps=5)])
    assert analyze(load_runs([back]))["collective_plans"][0]["kind"] == "ring paced"
    squeezed = _write(tmp_path / "squeezed", [ev(0, "run_start"), ev(2, "collective_plan", rank=0, seq=9,
                                                                      plan={**plan, "squeeze": [1, 2]}),
                                              ev(3, "run_end", steps=5)])
    assert analyze(load_runs([squeezed]))["collective_plans"][0]["kind"] == "pipelined, squeezing rank(s) 1, 2"


def test_a_rejected_plan_is_listed_with_its_time_and_the_rings_or_why(tmp_path):
    plan = {"kind": "pipelined", "order": [0, 1, 2, 3], "split": [333, 333, 100, 333], "pieces": 8, "aggregators": []}
    run = _write(tmp_path / "run", [ev(0, "run_start"),
                                    ev(2, "collective_plan_rejected", rank=0, seq=4, plan=plan, seconds=0.33,
                                       previous_seconds=0.3, contended=["up:2"], for_collectives=32),
                                    ev(3, "run_end", steps=5)])
    [p] = analyze(load_runs([run]))["collective_plans"]
    assert p["kind"] == "rejected pipelined (0.330 s vs the ring's 0.300 s)" and p["contended"] == ["up:2"]
    cleared = _write(tmp_path / "cleared", [ev(0, "run_start"), ev(2, "collective_plan_rejected", rank=0, seq=9, plan=plan,
                                                                  why="its slow links cleared"), ev(3, "run_end", steps=5)])
    assert analyze(load_runs([cleared]))["collective_plans"][0]["kind"] == "rejected pipelined (its slow links cleared)"
