"""Net ETTR: failure-free overhead per policy, calibration from overhead.json, break-even, the --out document."""
from __future__ import annotations

import json
import math

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from unbroken.sim import SimError, default_mix, make_policy, monte_carlo, run_policy
from unbroken.sim.calibrate import load_calibrations, load_overhead
from unbroken.sim.cluster import Cluster, make_trace
from unbroken.sim.command import simulate
from unbroken.sim.costs import Workload
from unbroken.sim.net import break_even_overhead, unbroken_ettr_at
from unbroken.sim.overhead import overhead_from_dict, overhead_fraction
from unbroken.sim.policies import (DEFAULT_OVERHEAD, POLICY_NAMES, UNCALIBRATED_OVERHEAD, CkptRestart,
                                   Unbroken)
from unbroken.sim.rates import FailureClass, FailureMix

W = Workload()
_app = typer.Typer()
_app.command()(simulate)
SMALL = ["--gpus", "1024", "--days", "3", "--seeds", "2", "--no-plot"]
OVERHEAD = {"ratio": {"zero1": {"2": 0.985, "4": 0.95}, "ddp": {"4": 0.99}},
            "ci95": {"zero1": {"2": [0.97, 0.99], "4": [0.93, 0.97]}, "ddp": {"4": [0.98, 1.0]}},
            "protect_every": 4, "rounds": 3, "commit": "0123abc", "dirty": False}


def _sim(*args):
    return CliRunner().invoke(_app, [str(a) for a in args])


def _write(tmp_path, data, name="overhead.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def _rows(res) -> dict:
    assert res.exit_code == 0, res.output
    return {r["policy"]: r for r in map(json.loads, res.stdout.splitlines())}


# --- net ETTR in the engine ---------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(POLICY_NAMES), lo=st.floats(0, 0.98), d=st.floats(1e-6, 0.5),
       gpus_log2=st.integers(10, 15), seed=st.integers(0, 50))
def test_net_ettr_decreases_as_overhead_grows(name, lo, d, gpus_log2, seed):
    hi = min(lo + d, 0.999)
    mix, cluster = default_mix(), Cluster(gpus=2 ** gpus_log2, days=2)
    trace = make_trace(cluster, mix, seed)
    a, b = (run_policy(make_policy(name, overhead=o), cluster, mix, W, seed, trace=trace) for o in (lo, hi))
    assert b.ettr < a.ettr and b.ettr_gross == pytest.approx(a.ettr_gross, rel=1e-12)
    assert b.ettr == pytest.approx(a.ettr_gross / (1 + hi), rel=1e-12)
    assert sum(b.time_s.values()) == pytest.approx(b.wall_s, rel=1e-9)


# The same runs before this change (commit 6b76872, gross ETTR, 5 days, seeds 0-1).
OLD_ETTR = {4096: {"ckpt-restart": 0.9625078982678238, "in-memory": 0.9915233929383966,
                   "replica-heal": 0.9981148821612261, "unbroken": 0.9955496892346929},
            131072: {"ckpt-restart": 0.6552961537118642, "in-memory": 0.8266271697953835,
                     "replica-heal": 0.94820446609168, "unbroken": 0.9623237053145093}}


@pytest.mark.parametrize("gpus", sorted(OLD_ETTR))
def test_zero_overhead_reproduces_the_old_gross_ettr(gpus):
    mix, cluster = default_mix(), Cluster(gpus=gpus, days=5)
    zero = {n: make_policy(n, overhead=0.0) for n in POLICY_NAMES}
    s = {x.policy: x for x in monte_carlo(zero, cluster, mix, W, seeds=2)}
    for n in POLICY_NAMES:
        assert s[n].ettr == s[n].ettr_gross and s[n].phases_h["overhead"] == 0
    for n in ("ckpt-restart", "replica-heal"):  # their schedules did not change: exactly the old numbers
        assert s[n].ettr == pytest.approx(OLD_ETTR[gpus][n], rel=1e-12)
    # in-memory and unbroken used to pay a blocking copy of (1 - overlap) * state / net per step; that
    # cost is now part of their overhead, and charging it as one gives the old numbers back (within 0.1
    # point: a blocking copy and a stretched step differ only in what a failure interrupts)
    copy = (1 - W.overlap) * W.state_gb / W.net_gbps / W.step_s
    old_model = {n: make_policy(n, overhead=copy) for n in ("in-memory", "unbroken")}
    for x in monte_carlo(old_model, cluster, mix, W, seeds=2):
        assert s[x.policy].ettr > OLD_ETTR[gpus][x.policy]
        assert x.ettr == pytest.approx(OLD_ETTR[gpus][x.policy], abs=1e-3)


def test_failure_free_run_costs_exactly_the_overhead_and_the_saves():
    mix = FailureMix(gpus=1024, days=1, classes=(FailureClass(name="x", count=1e-9, kind="operable"),))
    cluster = Cluster(gpus=64, days=1)
    r = run_policy(CkptRestart(interval_s=100.0, save_s=25.0, overhead=0.1), cluster, mix, W, 0)
    assert r.failures == 0 and r.failure_free_overhead == pytest.approx(1.1 * 1.25 - 1)
    assert r.ettr == pytest.approx(1 / (1.1 * 1.25), abs=2e-3)
    u = run_policy(Unbroken(overhead=0.25), cluster, mix, W, 0)
    assert u.ettr == pytest.approx(1 / (1 + u.failure_free_overhead), abs=1e-3) and u.overhead == 0.25


def test_every_policy_states_its_default_overhead():
    assert DEFAULT_OVERHEAD == {"ckpt-restart": 0.0, "in-memory": 0.0, "replica-heal": 0.02, "unbroken": 0.16}
    for n in POLICY_NAMES:
        assert make_policy(n).overhead == DEFAULT_OVERHEAD[n]
    for bad in (-0.01, 1.0, 2, math.nan, math.inf, True, "0.1"):
        with pytest.raises(SimError, match=r"unbroken.overhead must be a fraction in \[0, 1\)"):
            Unbroken(overhead=bad)


# --- calibration from overhead.json ---------------------------------------------------------------


def test_calibration_takes_zero1_at_the_largest_world_size(tmp_path):
    cal = load_overhead(_write(tmp_path, OVERHEAD))
    assert (cal.strategy, cal.world, cal.ratio) == ("zero1", 4, 0.95)
    assert cal.overhead == pytest.approx(1 / 0.95 - 1)
    assert cal.overhead_ci95 == pytest.approx((1 / 0.97 - 1, 1 / 0.93 - 1))
    p = cal.provenance()
    assert p["file"].endswith("overhead.json") and p["commit"] == "0123abc" and p["protect_every"] == 4
    assert overhead_fraction(1.02) == 0.0  # faster than native is clamped, not a negative cost
    fast = overhead_from_dict({"ratio": {"zero1": {"8": 1.02}}}, "x.json")
    assert fast.overhead == 0.0 and any("clamped" in n for n in fast.notes) and any("ci95" in n for n in fast.notes)


def test_calibrate_flag_puts_the_measured_overhead_into_the_output(tmp_path):
    path = _write(tmp_path, OVERHEAD)
    for arg in (path, tmp_path):  # the file itself, or the directory holding it
        rows = _rows(_sim(*SMALL, "--json", "--policy", "unbroken,ckpt-restart", "--calibrate", arg))
        u = rows["unbroken"]
        assert u["overhead"] == pytest.approx(1 / 0.95 - 1, abs=1e-6)
        assert u["ettr"] == pytest.approx(u["ettr_gross"] / (1 + 1 / 0.95 - 1), abs=1e-5)
        src = u["overhead_source"]
        assert src["kind"] == "calibrated" and src["file"] == str(path) and src["commit"] == "0123abc"
        assert rows["ckpt-restart"]["overhead"] == 0.0
    both = load_calibrations([tmp_path, _write(tmp_path, {"baseline": {"recovery_s": [5.0]},
                                                          "unbroken": {"recovery_s": [1.0]}}, "rec.json")])
    assert both.recovery is not None and both.overhead is not None and both.overhead_missing is None


def test_overhead_flag_and_set_override_the_calibration(tmp_path):
    path = _write(tmp_path, OVERHEAD)
    res = _sim(*SMALL, "--json", "--policy", "unbroken", "--calibrate", path, "--overhead", "0.05")
    u = _rows(res)["unbroken"]
    assert u["overhead"] == 0.05 and u["overhead_source"]["kind"] == "cli" and "uncalibrated" not in res.stderr
    r = _rows(_sim(*SMALL, "--json", "--set", "in-memory.overhead=0.01"))["in-memory"]
    assert r["overhead"] == 0.01 and r["overhead_source"] == {"kind": "set", "source": "--set in-memory.overhead=0.01"}


def test_a_missing_overhead_file_uses_the_stated_default_and_says_so(tmp_path):
    _write(tmp_path, {"baseline": {"recovery_s": [5.0]}, "unbroken": {"recovery_s": [1.0]}}, "recovery.json")
    for extra in (["--calibrate", tmp_path], []):
        res = _sim(*SMALL, "--json", "--policy", "unbroken", *extra)
        u = _rows(res)["unbroken"]
        assert u["overhead"] == UNCALIBRATED_OVERHEAD and u["overhead_source"]["kind"] == "uncalibrated"
        notes = [line for line in res.stderr.splitlines() if "uncalibrated" in line]
        assert len(notes) == 1 and "0.16" in notes[0] and "--overhead F" in notes[0]
    assert "no overhead.json in" in _sim(*SMALL, "--policy", "unbroken", "--calibrate", tmp_path).stderr


@pytest.mark.parametrize("data,message", [
    ("{not json", "is not valid JSON"),
    ({"ratio": {"zero1": {"4": -0.5}}}, "ratio.zero1.4 must be a number > 0"),
    ({"ratio": {"zero1": {"4": 0.4}}}, "outside the [0, 1) the simulator models"),
    ('{"ratio": {"zero1": {"4": NaN}}}', "ratio.zero1.4 must be a number > 0"),
    ({"ratio": {"zero1": {"4": "fast"}}}, "ratio.zero1.4 must be a number > 0"),
    ({"ratio": {"ddp": {"4": 0.99}}}, "no ratio for strategy 'zero1' (has: ddp)"),
    ({"ratio": 0.98}, "'ratio' must map strategy"),
    ({"ratio": {"zero1": {"four": 0.98}}}, "world size 'four', not an integer"),
    ({"ratio": {"zero1": {"4": 0.98}}, "ci95": {"zero1": {"4": [0.99, 0.97]}}}, "must be [lo, hi]"),
    ({"results": []}, "neither the recovery benchmark's JSON"),
])
def test_bad_overhead_files_are_one_line_errors_with_exit_2(tmp_path, data, message):
    path = _write(tmp_path, data)
    res = _sim(*SMALL, "--policy", "unbroken", "--calibrate", path)
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1 and "Traceback" not in res.output
    assert message in res.stderr
    assert "rerun" in res.stderr or "pass " in res.stderr  # says how to fix it


@pytest.mark.parametrize("args,message", [
    (["--overhead", "-0.1"], "--overhead must be a fraction in [0, 1)"),
    (["--overhead", "1"], "--overhead must be a fraction in [0, 1)"),
    (["--overhead", "nan"], "--overhead must be a fraction in [0, 1)"),
    (["--set", "unbroken.overhead=1.5"], "unbroken.overhead must be a fraction in [0, 1)"),
    (["--set", "replica-heal.overhead=NaN"], "replica-heal.overhead must be a fraction in [0, 1)"),
    (["--sizes", "1024,lots"], "--sizes '1024,lots'"),
    (["--break-even", "--policy", "unbroken"], "--break-even compares unbroken with ckpt-restart"),
])
def test_bad_overhead_options_are_one_line_errors_with_exit_2(args, message):
    res = _sim(*SMALL, *args)
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1 and message in res.stderr


# --- break-even ------------------------------------------------------------------------------------


def test_break_even_bisection_on_a_known_curve():
    gross = 0.96
    assert break_even_overhead(lambda o: gross / (1 + o), 0.8) == pytest.approx(0.2, abs=1e-4)
    assert break_even_overhead(lambda o: gross / (1 + o), 0.8) <= 0.2  # never above the true break-even
    assert break_even_overhead(lambda o: 1 - o, 0.75, tol=1e-6) == pytest.approx(0.25, abs=1e-6)
    assert break_even_overhead(lambda o: gross / (1 + o), 0.97) is None  # loses even at zero overhead
    assert break_even_overhead(lambda o: gross / (1 + o), 0.1) == pytest.approx(0.999)  # wins at any overhead


def test_break_even_of_the_simulator_matches_gross_over_target():
    mix, cluster = default_mix(), Cluster(gpus=16384, days=5)
    ck = monte_carlo({"c": CkptRestart()}, cluster, mix, W, seeds=2)[0]
    ettr_at = unbroken_ettr_at(Unbroken(), cluster, mix, W, seeds=2, seed=0)
    gross = ettr_at(0.0)
    assert break_even_overhead(ettr_at, ck.ettr) == pytest.approx(gross / ck.ettr - 1, abs=2e-4)


def test_out_document_has_sizes_break_even_and_the_commit(tmp_path):
    out = tmp_path / "net.json"
    res = _sim("--sizes", "1024,2048", "--days", "2", "--seeds", "2", "--no-plot", "--break-even", "--out", out)
    assert res.exit_code == 0, res.output
    assert "break-even overhead of unbroken at 2,048 GPUs" in res.stdout
    doc = json.loads(out.read_text())
    assert {"commit", "dirty", "options", "overhead", "sizes"} <= set(doc)
    assert [s["gpus"] for s in doc["sizes"]] == [1024, 2048]
    assert doc["overhead"]["unbroken"] == {"value": 0.16, **doc["overhead"]["unbroken"]}
    for s in doc["sizes"]:
        be, pols = s["break_even_overhead"], s["policies"]
        gross, ck = pols["unbroken"]["ettr_gross"], pols["ckpt-restart"]["ettr"]
        assert be["vs_ckpt_restart"] == pytest.approx(gross / ck - 1, abs=3e-4)
        assert s["unbroken_ettr_at_overhead"]["0.16"] == pytest.approx(pols["unbroken"]["ettr"], abs=1e-6)
        assert set(pols) == set(POLICY_NAMES)
