"""--tee: the user's prints and tracebacks on the console, each line prefixed [rank N]
(rank 0 by default), the prefix following the rank to a shadow; logs/PROC.log unchanged."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import _procs_of, run_cli

pytestmark = pytest.mark.timeout(180)
SCRIPT = str(Path(__file__).parent / "scripts" / "tee_prints.py")
BASE = ["--world-size", "2", "--steps", "6", "--chunk-kb", "16"]


def _hello(rank: int, step: int) -> str:
    return f"[rank {rank}] hello from rank {rank} step {step}\n"


def _log(run_dir: Path, proc: str) -> str:
    return (run_dir / "logs" / f"{proc}.log").read_text()


def test_rank_0_by_default_on_stdout_and_the_logs_keep_everything(tmp_path):
    run_dir = tmp_path / "r"
    cmd = [sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir), "--no-progress", *BASE, SCRIPT]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    finally:
        assert not _procs_of(run_dir.resolve())
    assert p.returncode == 0, p.stderr[-3000:]
    assert all(_hello(0, s) in p.stdout for s in range(1, 7)), p.stdout
    assert "[rank 0] bye from rank 0\n" in p.stdout  # the last line had no newline
    assert "[rank 1]" not in p.stdout and "[rank" not in p.stderr
    assert p.stdout.index(_hello(0, 6)) < p.stdout.index("run summary")  # flushed before the summary
    assert "hello from rank 1 step 6\nbye from rank 1" in _log(run_dir, "n0-w1")
    assert "hello from rank 0 step 1\n" in _log(run_dir, "n0-w0") and "[rank" not in _log(run_dir, "n0-w0")


def test_tee_all_with_json_shows_every_rank_on_stderr(tmp_path):
    p = run_cli(tmp_path / "r", *BASE, "--tee", "all", SCRIPT, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["ok"]  # stdout stays one JSON document
    for rank in (0, 1):
        assert all(_hello(rank, s) in p.stderr for s in range(1, 7)), p.stderr
        assert f"[rank {rank}] bye from rank {rank}\n" in p.stderr


def test_a_shadow_that_takes_rank_0_is_shown_as_rank_0(tmp_path):
    run_dir = tmp_path / "r"
    p = run_cli(run_dir, *BASE, "--inject", "sigkill:rank=0,step=3,phase=optimizer", SCRIPT, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(json.loads(p.stdout)["recoveries"]) == 1
    shadow = next(f.stem for f in (run_dir / "logs").glob("n0-s*.log") if "hello" in f.read_text())
    assert "hello from rank 0 step 6" in _log(run_dir, shadow)
    assert "hello from rank 0 step 6" not in _log(run_dir, "n0-w0")  # killed at step 3
    assert _hello(0, 1) in p.stderr and _hello(0, 6) in p.stderr and "[rank 0] bye from rank 0\n" in p.stderr
    assert "[rank 1]" not in p.stderr


def test_the_script_s_traceback_reaches_the_console(tmp_path):
    run_dir = tmp_path / "r"
    p = run_cli(run_dir, *BASE, SCRIPT, "--raise-at", "3", timeout=150)
    assert p.returncode == 1, p.stderr[-3000:]
    tee_lines = [ln for ln in p.stderr.splitlines() if ln.startswith("[rank 0] ")]
    assert "[rank 0] Traceback (most recent call last):" in tee_lines
    assert "[rank 0] ValueError: bad value at step 3" in tee_lines
    assert any("tee_prints.py" in ln for ln in tee_lines)
    assert "ValueError: bad value at step 3" in _log(run_dir, "n0-w0")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value,needle", [
    ("x", "--tee must be 'all', 'none' or rank numbers separated by commas, got 'x'"),
    ("0,,1", "--tee must be 'all', 'none' or rank numbers"),
    ("2", "--tee names rank 2 but the job has ranks 0..1"),
])
def test_a_bad_tee_value_is_one_line_exit_2(tmp_path, value, needle):
    p = run_cli(tmp_path / "r", *BASE, "--tee", value, SCRIPT)
    assert p.returncode == 2 and needle in p.stderr, p.stderr
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert not (tmp_path / "r").exists()
