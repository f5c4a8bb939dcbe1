"""`unbroken chaos`: random fault schedules as real jobs, each bitwise against a failure-free run."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.bench.chaos import (ChaosArgs, classify, config_text, procs_under, report, run_chaos,
                                   run_job)

RECORD_KEYS = {"schedules", "passed", "divergent", "hung", "failed", "steps_lost", "seed", "args", "per_schedule",
               "commit", "dirty", "wall_s"}
# Measured here (2 cores shared with other test runs): a failure-free job 6-7 s, a faulted
# one 7-12 s idle and up to ~40 s under load; a sigstop adds hang_timeout_s (5 s).
PER_JOB_S = 40


def _procs_under(root: Path) -> list[int]:
    return procs_under(root.resolve())


def _chaos_cli(tmp_path: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "unbroken.cli", "chaos", "--out", str(tmp_path / "chaos.json"),
           "--keep-runs", str(tmp_path / "runs"), *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    finally:
        assert _procs_under(tmp_path) == [], "chaos left processes behind"


def _assert_all_passed(tmp_path: Path, p: subprocess.CompletedProcess, runs: int) -> None:
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-2000:]}"
    assert f"{runs} passed, 0 failed" in p.stdout
    rec = json.loads((tmp_path / "chaos.json").read_text())
    assert RECORD_KEYS <= set(rec)
    assert (rec["schedules"], rec["passed"], rec["divergent"], rec["hung"], rec["failed"]) == (runs, runs, 0, 0, 0)
    assert rec["steps_lost"] == 0 and rec["steps_lost_unmeasured"] == 0
    assert rec["unfired"] == 0, [r for r in rec["per_schedule"] if r["unfired"]]  # every fault really happened
    assert len(rec["per_schedule"]) == runs and len(rec["commit"] or "x") > 0


@pytest.mark.timeout(3 * PER_JOB_S)
def test_two_chaos_schedules_pass_bitwise(tmp_path):
    # two keep the default suite short; `pytest -m slow` runs the two hundred below
    p = _chaos_cli(tmp_path, "--runs", "2", "--seed", "12", timeout=3 * PER_JOB_S - 20)
    _assert_all_passed(tmp_path, p, 2)


@pytest.mark.slow
@pytest.mark.timeout(201 * PER_JOB_S)
def test_two_hundred_chaos_schedules_pass_bitwise(tmp_path):
    p = _chaos_cli(tmp_path, "--runs", "200", "--seed", "2026", timeout=201 * PER_JOB_S - 20)  # bench/results/chaos.json's seed
    _assert_all_passed(tmp_path, p, 200)


@pytest.mark.timeout(4 * PER_JOB_S)
def test_a_schedule_that_cannot_pass_is_reported_with_a_command_that_reproduces_it(tmp_path):
    # a wrong reference: whatever the job does, it cannot pass
    lines: list[str] = []
    rec = run_chaos(ChaosArgs(runs=1, seed=5), out=tmp_path / "chaos.json", work_dir=tmp_path / "runs",
                    echo=lines.append, reference_sha="0" * 64)
    (r,) = rec["per_schedule"]
    assert r["outcome"] in ("divergent", "failed") and rec["passed"] == 0 and r["reason"]
    report(rec, echo=lines.append)
    out = "\n".join(lines)
    assert "0 passed, 1 failed" in out and r["reproduce"] in out
    assert json.loads((tmp_path / "chaos.json").read_text())["per_schedule"][0]["outcome"] == r["outcome"]
    # the command runs the same job with the same faults
    cmd = shlex.split(r["reproduce"])
    assert cmd[:2] == ["unbroken", "run"] and "--config" in cmd
    assert [cmd[i + 1] for i, x in enumerate(cmd) if x == "--inject"] == r["specs"]
    again = tmp_path / "again"
    res = run_job(again, cmd[2:], timeout_s=2 * PER_JOB_S)
    assert sorted(res.fired) == sorted(r["specs"])
    assert _procs_under(tmp_path) == []


def test_a_job_past_its_timeout_is_killed_and_reported_hung(tmp_path):
    (tmp_path / "chaos.toml").write_text(config_text())
    res = run_job(tmp_path / "run", ChaosArgs(runs=1, seed=0).job_args(tmp_path / "chaos.toml"), timeout_s=1.0)
    assert res.rc is None and _procs_under(tmp_path) == []
    assert classify(res, reference_sha="0" * 64, world_size=4)[0] == "hung"


def test_bad_chaos_arguments_are_one_line_errors(tmp_path):
    for args, needle in ((["--runs", "0"], "--runs must be >= 1"), (["--steps", "3"], "--steps >= 4"),
                         (["--timeout-s", "0"], "--timeout-s")):
        p = _chaos_cli(tmp_path, *args, timeout=60)
        assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not (tmp_path / "chaos.json").exists()


def test_a_failed_reference_stops_chaos_with_exit_1(tmp_path):
    p = _chaos_cli(tmp_path, "--runs", "1", "--timeout-s", "1", timeout=60)
    assert p.returncode == 1 and "reference run failed" in p.stderr
    assert not (tmp_path / "runs" / "000").exists()  # no schedule ran


@pytest.mark.slow
@pytest.mark.timeout(29 * PER_JOB_S)
def test_two_node_chaos_with_whole_node_losses_passes_bitwise(tmp_path):
    p = _chaos_cli(tmp_path, "--runs", "28", "--seed", "3", "--nnodes", "2", timeout=29 * PER_JOB_S - 20)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-2000:]}"
    rec = json.loads((tmp_path / "chaos.json").read_text())
    assert (rec["passed"], rec["divergent"], rec["hung"], rec["steps_lost"]) == (28, 0, 0, 0)
    node = [r for r in rec["per_schedule"] if r["pattern"] == "node_loss"]
    assert len(node) == 4 and all(not r["unfired"] for r in node)  # every node loss really happened
