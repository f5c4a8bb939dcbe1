"""`unbroken simulate`: JSON lines, plot, simulated event logs, calibration files, bad input -> exit 2."""
from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from unbroken.events import KINDS, read_events
from unbroken.sim import SimError
from unbroken.sim.calibrate import calibrate, load_calibration
from unbroken.sim.command import simulate
from unbroken.sim.policies import CkptRestart, Unbroken

_app = typer.Typer()
_app.command()(simulate)
SMALL = ["--gpus", "1024", "--days", "5", "--seeds", "2"]
BENCH = {"baseline": {"recovery_s": [6.0, 8.0], "steps_redone": [12, 14]},
         "unbroken": {"recovery_s": [1.0, 1.2], "steps_redone": [1, 1], "state_bytes_per_rank": 50_000_000,
                      "breakdown": {"detect": 0.3, "decide": 0.05, "regroup": 0.4, "rebuild": 0.1, "redo": 0.2}},
         "ratio": 7.0}


def _sim(*args):
    return CliRunner().invoke(_app, [str(a) for a in args])


def _bench(tmp_path, data) -> str:
    p = tmp_path / "recovery.json"
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


def test_simulate_is_registered_in_the_main_cli():
    from unbroken.cli import app

    assert "simulate" in {c.name for c in app.registered_commands}


def test_json_prints_one_object_per_policy(tmp_path):
    res = _sim(*SMALL, "--json", "--no-plot")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["policy"] for r in rows] == ["ckpt-restart", "in-memory", "replica-heal", "unbroken"]
    for r in rows:
        assert {"policy", "gpus", "days", "ettr", "failures", "mttf_h", "ettr_ci95", "phases_h"} <= set(r)
        assert r["gpus"] == 1024 and r["days"] == 5 and 0 < r["ettr"] <= 1
        assert r["mttf_h"] == pytest.approx(54 * 24 / 419 * 16, rel=1e-3)


def test_table_and_plot(tmp_path):
    png = tmp_path / "out" / "ettr.png"
    res = _sim("--gpus", "4096", "--days", "3", "--seeds", "2", "--policy", "unbroken,ckpt-restart",
               "--plot", png, "--timing")
    assert res.exit_code == 0, res.output
    assert "unbroken" in res.stdout and "ckpt-restart" in res.stdout and "ETTR" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "timing: unbroken" in res.stderr


def test_events_are_a_readable_log_of_known_kinds(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    res = _sim("--gpus", "16384", "--days", "10", "--seeds", "1", "--policy", "unbroken", "--no-plot",
               "--events", path)
    assert res.exit_code == 0, res.output
    evs = read_events(path)
    kinds = {e.kind for e in evs}
    assert kinds <= set(KINDS)
    assert {"run_start", "run_end", "fault_detected", "fault_classified", "recovery_phase", "recovered"} <= kinds
    assert evs[0].kind == "run_start" and evs[-1].kind == "run_end"
    assert all(e.fields["phase"] in ("detect", "decide", "regroup", "rebuild", "redo")
               for e in evs if e.kind == "recovery_phase")
    faults = [e for e in evs if e.kind == "fault_detected"]
    assert all(e.time - e.fields["occurred_at"] >= 0 for e in faults) and len(faults) > 50
    assert {e.fields["path"] for e in evs if e.kind == "recovered"} <= {"tier1", "tier2"}


def test_events_limit_truncates_with_a_warning(tmp_path):
    path = tmp_path / "events.jsonl"
    res = _sim("--gpus", "16384", "--days", "10", "--seeds", "1", "--policy", "replica-heal", "--no-plot",
               "--events", path, "--events-limit", "40")
    assert res.exit_code == 0, res.output
    evs = read_events(path)
    assert len(evs) <= 40 and any(e.kind == "warning" for e in evs) and evs[-1].kind == "run_end"


@pytest.mark.parametrize("args,message", [
    (["--gpus", "1000", "--node-size", "7"], "--node-size 7 does not divide --gpus 1000"),
    (["--gpus", "0"], "--gpus must be an integer >= 1"),
    (["--days", "0"], "--days must be a number > 0"),
    (["--policy", "magic"], "unknown policy 'magic'"),
    (["--seeds", "0"], "--seeds must be an integer >= 1"),
    (["--rates", "/nonexistent/rates.json"], "cannot read rates file"),
    (["--calibrate", "/nonexistent/recovery.json"], "cannot read calibration file"),
    (["--events", "/tmp/never-written.jsonl"], "--events writes one run of one policy"),
    (["--replicas", "1"], "replicas must be an integer >= 2"),
    (["--step-s", "-1"], "workload.step_s must be a number > 0"),
])
def test_bad_input_exits_2_with_one_error_line(args, message):
    res = _sim(*SMALL, "--no-plot", *args)
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: ") and message in res.stderr and res.stderr.count("\n") == 1
    assert "Traceback" not in res.output


def test_bad_rates_file_exits_2(tmp_path):
    p = tmp_path / "rates.json"
    p.write_text(json.dumps({"gpus": 8, "days": 1, "classes": [{"name": "gpu", "count": -1, "kind": "replace"}]}))
    res = _sim(*SMALL, "--no-plot", "--rates", p)
    assert res.exit_code == 2 and "count must be a number > 0" in res.stderr


def test_type_errors_from_typer_also_exit_2():
    assert _sim("--gpus", "many").exit_code == 2


# --- calibration --------------------------------------------------------------------------------------


def test_calibration_scales_measured_costs(tmp_path):
    cal = load_calibration(_bench(tmp_path, BENCH))
    assert cal.ranks == 4 and cal.baseline_recovery_s == pytest.approx(7.0) and cal.state_gb == 0.05
    assert any("world_size" in n for n in cal.notes)
    ub = calibrate(Unbroken(), cal)
    assert (ub.detect_s, ub.decide_s) == (0.3, 0.05)
    assert ub.regroup_per_log2_s == pytest.approx(0.2)  # 0.4 s at log2(4) = 2
    assert ub.rebuild_bench_s_per_gb == pytest.approx(2.0) and ub.protect_every == 1
    assert ub.restart.relaunch_per_log2_s == pytest.approx(3.5)
    ck = calibrate(CkptRestart(), cal)
    assert ck.restart.relaunch_per_log2_s == pytest.approx(3.5) and ck.restart.detect_s == 60.0


def test_calibration_without_optional_keys_uses_defaults_and_says_so(tmp_path):
    minimal = {"baseline": {"recovery_s": [10.0]}, "unbroken": {"recovery_s": [2.6]}}
    cal = load_calibration(_bench(tmp_path, minimal))
    assert cal.breakdown == {} and cal.state_gb is None and cal.steps_redone is None
    assert len(cal.notes) >= 3
    ub = calibrate(Unbroken(), cal)
    total = ub.detect_s + ub.decide_s + ub.regroup_per_log2_s * 2  # the default model at 4 ranks
    assert total == pytest.approx(2.6) and ub.rebuild_bench_s_per_gb is None
    res = _sim(*SMALL, "--no-plot", "--json", "--calibrate", _bench(tmp_path, minimal))
    assert res.exit_code == 0, res.output
    assert "calibration: no unbroken.breakdown" in res.stderr


@pytest.mark.parametrize("data,match", [
    ("not json", "not valid JSON"),
    ([1, 2], "expected a JSON object"),
    ({"baseline": {"recovery_s": [1.0]}}, "needs an object 'unbroken'"),
    ({"baseline": {}, "unbroken": {"recovery_s": [1.0]}}, "missing 'baseline.recovery_s'"),
    ({"baseline": {"recovery_s": []}, "unbroken": {"recovery_s": [1.0]}}, "non-empty list"),
    ({"baseline": {"recovery_s": [-1]}, "unbroken": {"recovery_s": [1.0]}}, "number >= 0"),
    ({"baseline": {"recovery_s": [1]}, "unbroken": {"recovery_s": [1.0], "breakdown": [1]}}, "map phase"),
    ({"baseline": {"recovery_s": [1]}, "unbroken": {"recovery_s": [1], "state_bytes_per_rank": 0}}, "> 0"),
])
def test_malformed_calibration_is_a_clear_error(tmp_path, data, match):
    path = _bench(tmp_path, data)
    with pytest.raises(SimError, match=match):
        load_calibration(path)
    res = _sim(*SMALL, "--no-plot", "--calibrate", path)
    assert res.exit_code == 2 and res.stderr.startswith("error: ")


def test_set_overrides_any_policy_parameter():
    base = json.loads(_sim(*SMALL, "--no-plot", "--json", "--policy", "unbroken").stdout)
    fast = _sim(*SMALL, "--no-plot", "--json", "--policy", "unbroken", "--set", "unbroken.detect_s=1",
                "--set", "unbroken.restart.detect_s=5", "--set", "ckpt-restart.interval_s=600")
    assert fast.exit_code == 0, fast.output
    assert json.loads(fast.stdout)["phases_h"]["detect"] < base["phases_h"]["detect"]
    for bad, msg in [("unbroken.nope=1", "no field 'nope'"), ("unbroken.detect_s=x", "JSON number"),
                     ("nobody.detect_s=1", "expected POLICY.FIELD=VALUE"), ("unbroken.restart=5", "set the fields"),
                     ("unbroken.detect_s=-1", "detect_s must be a number >= 0")]:
        res = _sim(*SMALL, "--no-plot", "--set", bad)
        assert res.exit_code == 2 and msg in res.stderr, (bad, res.output)
