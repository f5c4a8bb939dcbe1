"""`unbroken bench interval`'s pure parts: the kill step, memory fractions, the JSON schema, option checks."""
from __future__ import annotations

import json

import pytest

from unbroken.bench import interval as iv
from unbroken.bench.common import write_result
from unbroken.events import Event


# --- the plan -----------------------------------------------------------------------------------
@pytest.mark.parametrize("k, step", [(1, 10), (2, 10), (4, 11), (8, 13), (16, 25), (32, 17)])
def test_kill_step_is_k_half_plus_one_past_a_parity_point_and_at_least_10(k, step):
    s = iv.kill_step(k)
    assert s == step and s >= iv.KILL_MIN_STEP
    point = s - (k // 2 + 1)
    assert point % k == 0 and point >= 0         # a parity point (0 is the initial build)
    assert s - 1 - point == k // 2               # killed in backward: the lost shard is replayed k//2 steps


def test_kill_step_is_the_first_such_step():
    for k in range(1, 40):
        s = iv.kill_step(k)
        assert s - k < iv.KILL_MIN_STEP           # one window earlier would be too early
    assert iv.kill_step(4, min_step=1) == 3
    with pytest.raises(ValueError):
        iv.kill_step(0)


def test_kill_rank_and_fault():
    assert iv.kill_rank(4) == 2 and iv.kill_rank(8) == 2 and iv.kill_rank(2) == 1 and iv.kill_rank(3) == 2
    f = iv.kill_fault(8, 4)
    assert (f.kind, f.rank, f.step, f.phase) == ("sigkill", 2, 13, "backward")


def test_variant_configs():
    off = iv.variant_config(None, 4, 48)
    assert (off.tier1, off.checkpoint_every, off.strategy, off.world_size, off.steps) == (False, 0, "zero1", 4, 48)
    k = iv.variant_config(8, 2, 16)
    assert (k.tier1, k.protect_every, k.checkpoint_every, k.strategy, k.world_size) == (True, 8, 0, "zero1", 2)


# --- reading runs -------------------------------------------------------------------------------
def _ev(kind, rank=0, **fields):
    return Event(time=0.0, kind=kind, rank=rank, gen=0, fields=fields)


def test_memory_fractions():
    fields = {"bytes": 100, "snapshot_bytes": 300, "gradient_log_bytes": 800, "protected_bytes": 400,
              "protect_every": 8}
    m = iv.memory(fields)
    assert (m["parity"], m["snapshot"], m["gradient_log"], m["protected"]) == (100, 300, 800, 400)
    assert m["fractions"] == {"parity": 0.25, "snapshot": 0.75, "gradient_log": 2.0, "total": 3.0}
    assert iv.memory(None) is None
    assert iv.memory({"bytes": 5})["fractions"]["parity"] is None      # no protected size: no fraction


def test_parity_built_prefers_rank_0_and_step_records_keep_last_execution():
    evs = [_ev("parity_built", rank=1, bytes=7), _ev("parity_built", rank=0, bytes=9), _ev("step", step=1, step_s=1.0),
           _ev("step", step=2, step_s=5.0, parity=True), _ev("step", rank=1, step=2, step_s=9.0),
           _ev("step", step=2, step_s=2.0, parity=True)]
    assert iv.parity_built(evs)["bytes"] == 9 and iv.parity_built([]) is None
    assert iv.step_records(evs) == [{"step": 1, "step_s": 1.0, "parity": False},
                                    {"step": 2, "step_s": 2.0, "parity": True}]


def test_kill_sample_reads_the_first_complete_recovery(tmp_path):
    summary = {"weights_sha256": "ab", "recoveries": [
        {"complete": False},
        {"complete": True, "recovery_s": 0.5, "detect_s": 0.1, "decide_s": 0.0, "regroup_s": 0.1,
         "rebuild_s": 0.05, "redo_s": 0.25}]}
    evs = [_ev("recovered", step=12, steps_replayed=2, path="tier1")]
    s = iv.kill_sample(summary, evs, reference_sha="ab", run_dir=tmp_path)
    assert (s["recovery_s"], s["rebuild_s"], s["steps_replayed"], s["path"], s["bitwise"]) == (0.5, 0.05, 2, "tier1",
                                                                                               True)
    assert iv.kill_sample(summary, evs, reference_sha="cd", run_dir=tmp_path)["bitwise"] is False
    with pytest.raises(RuntimeError, match="no complete recovery"):
        iv.kill_sample({"recoveries": [{"complete": False}]}, evs, reference_sha="ab", run_dir=tmp_path)


# --- the JSON builder ---------------------------------------------------------------------------
def _records(steps, k=None, base=1.0, parity_s=0.4):
    """Steps 1..steps: `base` s each, plus `parity_s` on parity steps (multiples of k)."""
    return [{"step": s, "step_s": base + (parity_s if k and s % k == 0 else 0.0), "parity": bool(k and s % k == 0)}
            for s in range(1, steps + 1)]


def _kill(recovery_s, replayed, bitwise=True):
    return {"recovery_s": recovery_s, "detect_s": 0.1, "decide_s": 0.0, "regroup_s": 0.1, "rebuild_s": 0.02,
            "redo_s": recovery_s - 0.22, "steps_replayed": replayed, "path": "tier1", "recoveries": 1,
            "bitwise": bitwise}


def _fake_samples(steps=16, rounds=2):
    built = {1: {"bytes": 10, "snapshot_bytes": 0, "gradient_log_bytes": 40, "protected_bytes": 40},
             4: {"bytes": 10, "snapshot_bytes": 40, "gradient_log_bytes": 160, "protected_bytes": 40}}
    return {"free": {"off": [_records(steps) for _ in range(rounds)],
                     1: [_records(steps, 1, parity_s=0.2) for _ in range(rounds)],
                     4: [_records(steps, 4) for _ in range(rounds)]},
            "kill": {1: [_kill(0.5, 0), _kill(0.7, 0)], 4: [_kill(0.6, 2), _kill(0.8, 2, bitwise=False)]},
            "parity_built": built}


def test_interval_result_from_fake_samples(tmp_path):
    res = iv.interval_result(_fake_samples(), ks=[1, 4], world=2, steps=16, rounds=2)
    assert res["ks"] == [1, 4] and (res["world"], res["steps"], res["rounds"]) == (2, 16, 2)
    assert res["overhead"]["1"] == pytest.approx(0.2)
    # K=4: window 3..14 (three whole periods), parity steps 4, 8, 12: mean 1 + 3 * 0.4 / 12
    assert res["window"]["4"] == [3, 14] and res["parity_steps"]["4"] == 3
    assert res["overhead"]["4"] == pytest.approx(0.1)
    for k in ("1", "4"):
        lo, hi = res["overhead_ci95"][k]
        assert lo <= res["overhead"][k] <= hi
    assert res["overhead_ci95"]["1"] == pytest.approx([0.2, 0.2])  # no spread, no interval
    assert res["off_step_s"] == pytest.approx(1.0)
    assert res["recovery_s"] == {"1": pytest.approx(0.6), "4": pytest.approx(0.7)}
    assert res["steps_replayed"] == {"1": 0, "4": 2}
    assert res["bitwise"] == {"1": True, "4": False}
    assert res["memory"]["4"]["fractions"] == {"parity": 0.25, "snapshot": 1.0, "gradient_log": 4.0, "total": 5.25}
    assert res["memory"]["1"]["snapshot"] == 0
    assert res["kill"] == {"rank": 1, "phase": "backward", "step": {"1": 10, "4": 11}}
    back = json.loads(write_result("interval", res, tmp_path).read_text())
    assert back["benchmark"] == "interval" and back["overhead_ci95"]["4"] == res["overhead_ci95"]["4"]


def test_table_and_plot_render(tmp_path):
    from rich.console import Console

    res = iv.interval_result(_fake_samples(), ks=[1, 4], world=2, steps=16, rounds=2)
    res["memory"]["1"] = None  # a missing parity_built event still renders
    console = Console(record=True, width=200)
    console.print(iv.table(res))
    text = console.export_text()
    assert "+10.0%" in text and "NO" in text
    iv.plot(res, tmp_path / "interval.png")
    assert (tmp_path / "interval.png").read_bytes()[:4] == b"\x89PNG"


# --- options ------------------------------------------------------------------------------------
def test_parse_ks():
    assert iv.parse_ks("8, 1,4,4") == [1, 4, 8]
    for bad in ("", "1,x", "0", "-2", "1.5"):
        with pytest.raises(ValueError, match="--ks"):
            iv.parse_ks(bad)


def test_validate():
    iv.validate(ks=[1, 2, 4, 8, 16], world=4, steps=48, rounds=3)
    iv.validate(ks=[1, 4], world=2, steps=16, rounds=1)
    cases = [({"rounds": 0}, "--rounds"), ({"world": 1}, "--world"), ({"ks": []}, "--ks"),
             ({"steps": 3}, "steady step"), ({"ks": [16], "steps": 20}, "use --steps 26"),
             ({"world": 6}, "parity_group")]
    for change, msg in cases:
        args = {"ks": [1, 4], "world": 4, "steps": 48, "rounds": 1, **change}
        with pytest.raises(ValueError, match=msg):
            iv.validate(**args)


def test_interval_command_is_registered_and_rejects_bad_options(tmp_path):
    from typer.testing import CliRunner

    from unbroken.cli import app

    runner = CliRunner()
    assert "interval" in runner.invoke(app, ["bench", "--help"]).output
    for args in (["--ks", "1,x"], ["--ks", "0"], ["--rounds", "0"], ["--world", "1"], ["--steps", "12"],
                 ["--world", "6"]):
        res = runner.invoke(app, ["bench", "interval", "--out-dir", str(tmp_path), *args])
        assert res.exit_code == 2, (args, res.output)
    assert not any(tmp_path.iterdir())


def test_a_failed_run_is_kept_for_reading(tmp_path, monkeypatch):
    from rich.console import Console

    run_dir = tmp_path / "k4-free-0"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text("{}\n")
    monkeypatch.setattr(iv, "run_job", lambda *a, **k: {"ok": False})
    monkeypatch.setattr(iv.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError, match="unbroken-bench-interval-failed-k4-free-0"):
        iv._run(iv.variant_config(4, 2, 16), run_dir, Console(quiet=True))
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("unbroken-bench-interval-failed-")]
    assert len(kept) == 1 and (kept[0] / "events.jsonl").read_text() == "{}\n"
